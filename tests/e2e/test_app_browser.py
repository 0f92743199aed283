"""The Gradio demo (app.py): query logic in process, then a real headless Chromium against the app on 127.0.0.1.

The browser test needs Debian ``chromium`` + ``chromium-driver`` and the ``gradio`` and ``selenium`` packages
(``bash tests/setup_browser.sh`` installs them). In CI (``CI`` set) a missing piece fails the test; locally
it is skipped with the reason. ``TAGCLIP_SKIP_BROWSER=1`` skips the browser test on purpose (refused in CI).
The screenshot goes to ``outputs/test-artifacts/app_browser.png``.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import REPO_ROOT, repo_env, save_tiny_model, synthetic_gallery

import app

QUERY = "a man in a blue hooded sweatshirt with a brown shoulder bag"
SCREENSHOT = REPO_ROOT / "outputs" / "test-artifacts" / "app_browser.png"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    model_dir = save_tiny_model(root / "model")
    gallery = synthetic_gallery(root / "data") / "images" / "test"
    return {"root": root, "model": model_dir, "gallery": gallery}


def test_missing_model_or_gallery_gives_a_clear_message(setup, tmp_path):
    message = app.load_searcher(str(tmp_path / "outputs/tagclip-synthetic/best"), str(setup["gallery"]))
    assert isinstance(message, str) and "No trained model" in message and app.MAIN_JOB in message
    message = app.load_searcher(str(setup["model"]), str(tmp_path / "no-images"))
    assert "No gallery images" in message
    assert app.run_query(message, "a man", 5) == ([], message)


def test_query_returns_ranked_badged_images(setup):
    searcher = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    assert not isinstance(searcher, str)
    items, status = app.run_query(searcher, QUERY, 4)
    assert len(items) == 4 and status.startswith("Top 4 of")
    ranks = [int(caption.split(" ")[0][1:]) for _, caption in items]
    assert ranks == [1, 2, 3, 4]
    assert all("predicted aerial" in c or "predicted ground" in c for _, c in items)
    assert all("true view:" in c for _, c in items)  # the synthetic annotations give the true views
    assert items[0][0].size == (128, 256 + 36)
    assert app.run_query(searcher, "   ", 4)[0] == []


MAGENTA = np.array(app.PATCH_COLOUR)


def _magenta_pixels(image) -> int:
    pixels = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(pixels - MAGENTA).sum(-1) < 60).sum())


def test_each_hit_explains_itself(setup):
    searcher = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    hits = searcher.search(QUERY, 3)
    whys = searcher.explain([h["path"] for h in hits])
    rows, cols = whys[0]["grid"]
    assert (rows, cols) == (4, 2)  # tiny model: 32x16 images, 8-pixel patches
    k = min(searcher.model.image_tse_k, rows * cols)
    assert all(len(w["patches"]) == k and len(set(w["patches"])) == k for w in whys)
    assert all(abs(w["aerial"] + w["ground"] - 1) < 1e-5 for w in whys)
    for hit, why in zip(hits, whys, strict=True):  # the badge's view is the router's
        assert hit["predicted_view"] == ("aerial" if why["aerial"] >= why["ground"] else "ground")
        assert abs(hit["predicted_view_score"] - max(why["aerial"], why["ground"])) < 1e-4
    image = app.badge(hits[0], whys[0])
    assert _magenta_pixels(image) > 100  # the patch outlines are drawn
    assert _magenta_pixels(app.badge(hits[0])) == 0
    split = round(128 * whys[0]["aerial"])  # the view bar: blue up to the aerial probability, then orange
    bar = np.asarray(image)[14]
    if split > 2:
        assert tuple(bar[1]) == app.BADGE_COLOURS["aerial"]
    if split < 126:
        assert tuple(bar[127]) == app.BADGE_COLOURS["ground"]


def _metadata(setup) -> list[dict[str, str]]:
    """The rows of the synthetic gallery's metadata/test.csv (path, view, camera, timestamp)."""
    with app.gallery_metadata(setup["gallery"]).open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_default_gallery_layout_finds_its_metadata(setup, tmp_path):
    assert app.gallery_metadata(setup["gallery"]) == setup["gallery"].parent.parent / "metadata" / "test.csv"
    assert app.gallery_metadata(tmp_path) is None


def test_view_filter_restricts_results_to_the_recorded_view(setup):
    searcher = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    rows = _metadata(setup)
    for view in ("aerial", "ground"):
        items, status = app.run_query(searcher, QUERY, 50, view, "")
        assert len(items) == sum(row["view"] == view for row in rows) > 0 and f"view {view}" in status
        assert all(f"true view: {view}" in caption for _, caption in items)


def test_camera_filter_returns_that_cameras_crops_on_the_default_gallery(setup):
    searcher = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    rows = _metadata(setup)
    for camera in sorted({row["camera"] for row in rows}):
        expected = {row["path"].split("/")[-1] for row in rows if row["camera"] == camera}
        items, status = app.run_query(searcher, QUERY, 50, "any", camera)
        assert {
            caption.rsplit(" · ", 1)[-1] for _, caption in items
        } == expected and f"camera {camera}" in status
    assert app.run_query(searcher, QUERY, 50, "any", "99")[0] == []  # a camera the gallery lacks: no hits


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("a man", 0), "integer from 1 to 50, got 0"),
        (("a man", -3), "integer from 1 to 50, got -3"),
        (("a man", 51), "integer from 1 to 50, got 51"),
        (("a man", 2.5), "integer from 1 to 50, got 2.5"),
        (("a man", "5"), "integer from 1 to 50, got '5'"),
        (("x" * 1001, 5), "1001 characters; the limit is 1000"),
        ((["a man"], 5), "must be text, got list"),
        (("a man", 5, "satellite"), "unknown view filter 'satellite'"),
        (("a man", 5, "any", ["7"]), "camera filter must be a camera id, got list"),
    ],
)
def test_bad_queries_are_clear_errors(setup, args, message):
    searcher = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    with pytest.raises(app.DemoInputError, match=re.escape(message)):
        app.run_query(searcher, *args)


def test_punctuation_only_query_is_a_clear_error(setup):
    searcher = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    with pytest.raises(ValueError, match="empty after cleaning"):
        app.run_query(searcher, "...!!", 5)


@pytest.mark.slow
def test_app_without_gradio_says_so_before_loading(tmp_path):
    code = (
        "import runpy, sys\n"
        "sys.modules['gradio'] = None\n"
        "sys.modules['modeling_tagclip'] = None  # loading anything would fail loudly\n"
        f"sys.argv = ['app.py', '--model', {str(tmp_path / 'nowhere')!r}]\n"
        f"runpy.run_path({str(REPO_ROOT / 'app.py')!r}, run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "The demo needs Gradio, the `demo` extra" in result.stderr
    assert "No trained model" not in result.stderr + result.stdout


def test_unknown_dtype_refused():
    with pytest.raises(app.DemoInputError, match="unknown dtype 'fp8'"):
        app.load_searcher("m", "g", dtype="fp8")


def test_bf16_demo_ranks_like_fp32(setup):
    full = app.load_searcher(str(setup["model"]), str(setup["gallery"]))
    half = app.load_searcher(str(setup["model"]), str(setup["gallery"]), dtype="bf16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    a, b = full.search(QUERY, 5), half.search(QUERY, 5)
    assert abs(a[0]["score"] - b[0]["score"]) < 3e-2


def _browser_problem() -> str | None:
    for module in ("gradio", "selenium"):
        if importlib.util.find_spec(module) is None:
            return f"python package {module!r} is not installed (run: bash tests/setup_browser.sh)"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "Debian chromium is not installed (run: bash tests/setup_browser.sh)"
    if not shutil.which("chromedriver"):
        return "chromium-driver (chromedriver) is not installed (run: bash tests/setup_browser.sh)"
    return None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() not in ("", "0", "false", "no")


def _require_browser() -> None:
    """Skip (or, in CI, fail) when the browser cannot run or ``TAGCLIP_SKIP_BROWSER`` asks to skip it."""
    if _flag("TAGCLIP_SKIP_BROWSER"):
        if _flag("CI"):
            pytest.fail("TAGCLIP_SKIP_BROWSER is set in CI, where the browser test must run")
        pytest.skip("TAGCLIP_SKIP_BROWSER is set: the browser test is skipped on request")
    problem = _browser_problem()
    if problem is None:
        return
    if _flag("CI"):
        pytest.fail(f"browser test cannot run in CI: {problem}")
    pytest.skip(problem)


def test_skip_browser_variable_skips_locally_and_fails_in_ci(monkeypatch):
    monkeypatch.setenv("TAGCLIP_SKIP_BROWSER", "1")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="skipped on request"):
        _require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="set in CI"):
        _require_browser()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"app.py exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"app.py did not answer on {url} within {timeout}s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def serve_app(model: Path, gallery: Path, tmp_path: Path):
    """Run ``python app.py`` on a free 127.0.0.1 port; yields its URL, stops it afterwards."""
    port, log = _free_port(), tmp_path / "app.log"
    env = repo_env(tmp_path, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    args = [sys.executable, str(REPO_ROOT / "app.py"), "--model", str(model), "--gallery", str(gallery)]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(f"http://127.0.0.1:{port}/", process, log)
        yield f"http://127.0.0.1:{port}/"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _chrome():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1500",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)


@pytest.mark.slow
def test_browser_query_shows_ranked_gallery(setup, tmp_path, monkeypatch):
    _require_browser()
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium must not try to download a driver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with serve_app(setup["model"], setup["gallery"], tmp_path) as url:
        driver = _chrome()
        try:
            driver.get(url)
            wait = WebDriverWait(driver, 120)
            box = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#query textarea"))
            box.send_keys(QUERY)
            driver.find_element(By.ID, "search").click()
            wait.until(lambda d: "Top " in d.find_element(By.ID, "status").text)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results img")) >= 4)
            status = driver.find_element(By.ID, "status").text
            assert "gallery images" in status and QUERY in status
            wait.until(
                lambda d: all(
                    i.get_attribute("complete") for i in d.find_elements(By.CSS_SELECTOR, "#results img")
                )
            )
            # captions are not cut: no caption element is wider than its box
            cut = driver.execute_script(
                "return [...document.querySelectorAll('#results .caption-label, #results .caption')]"
                ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)"
            )
            assert cut == [], f"captions cut off: {cut}"
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            assert driver.save_screenshot(str(SCREENSHOT))
            results_png = driver.find_element(By.ID, "results").screenshot_as_png
            # the camera filter on the default gallery: only that camera's crops (its metadata is loaded)
            camera = _metadata(setup)[0]["camera"]
            expected = sum(row["camera"] == camera for row in _metadata(setup))
            driver.find_element(By.CSS_SELECTOR, "#camera textarea, #camera input").send_keys(camera)
            driver.find_element(By.ID, "search").click()
            wait.until(lambda d: f"camera {camera}" in d.find_element(By.ID, "status").text)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#results img")) == expected)
            assert f"Top {expected} of" in driver.find_element(By.ID, "status").text
        finally:
            driver.quit()
    from PIL import Image

    with Image.open(io.BytesIO(results_png)) as shot:
        results = shot.convert("RGB")
    # the explanation is on screen, in the gallery: TSE patch outlines (magenta) and the router's view bars
    # (a near-uniform tiny model: both the blue aerial and the orange ground part are wide)
    assert _magenta_pixels(results) > 200
    pixels = np.asarray(results).astype(int)
    near = lambda colour: int((np.abs(pixels - np.array(colour)).sum(-1) < 12).sum())  # noqa: E731
    assert near(app.BADGE_COLOURS["aerial"]) > 300 and near(app.BADGE_COLOURS["ground"]) > 300


FOLLOW_QUERY = "a woman in a red coat with a black backpack"


def _expected_follow(model: Path, tmp_path: Path) -> dict:
    """What the "Follow a person" tab must show, computed in this process with the same model and footage."""
    from modeling_tagclip.retrieval.loading import load_model
    from modeling_tagclip.video.follow import FollowSession

    net, processor = load_model(str(model))
    session = FollowSession(net, processor, tmp_path / "expected")
    session.use_synthetic()
    hits = session.search(FOLLOW_QUERY, 8)
    like = session.more_like(hits[0], 8)
    return {"tracks": session.tracks(), "hits": hits, "like": like, "cameras": {h["camera"] for h in like}}


def _click_tab(driver, label: str) -> None:
    from selenium.webdriver.common.by import By

    tab = next(b for b in driver.find_elements(By.CSS_SELECTOR, "button[role='tab']") if label in b.text)
    tab.click()


@pytest.mark.slow
def test_browser_follows_a_person_through_footage(setup, tmp_path, monkeypatch):
    """Upload a video and ingest it; in a fresh session use the synthetic footage, describe the person, click
    the first hit: more like it and its per-camera timeline, as the in-process flow computes them."""
    _require_browser()
    monkeypatch.setenv("SE_OFFLINE", "true")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from modeling_tagclip.video.follow import DEMO_FOOTAGE
    from modeling_tagclip.video.footage import render_footage

    expected = _expected_follow(setup["model"], tmp_path)
    upload = tmp_path / "street.mp4"  # a video of the user's: one street camera of the synthetic footage
    shutil.copyfile(render_footage(tmp_path / "mine", **DEMO_FOOTAGE).videos[0], upload)
    status = lambda d: d.find_element(By.ID, "follow-status").text  # noqa: E731
    started = time.monotonic()
    with serve_app(setup["model"], setup["gallery"], tmp_path) as url:
        driver = _chrome()
        try:
            wait = WebDriverWait(driver, 120)
            driver.get(url)
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "button[role='tab']"))
            _click_tab(driver, "Follow a person")
            wait.until(lambda d: d.find_element(By.ID, "follow-find").is_displayed())
            driver.find_element(By.ID, "follow-find").click()  # nothing ingested yet: one error line
            wait.until(lambda d: status(d).startswith("Error:"))
            assert (
                status(driver)
                == "Error: the gallery is empty: ingest a video or use the synthetic footage first"
            )
            driver.find_element(By.CSS_SELECTOR, "#follow-video input[type='file']").send_keys(str(upload))
            time.sleep(1)  # the upload finishes before the click
            driver.find_element(By.ID, "follow-ingest").click()
            wait.until(lambda d: status(d).startswith("Ingested"))
            assert re.match(r"Ingested 1 video\(s\): [1-9]\d* new track\(s\)", status(driver)), status(driver)

            driver.get(url)  # a new browser session: a gallery of its own
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "button[role='tab']"))
            _click_tab(driver, "Follow a person")
            wait.until(lambda d: d.find_element(By.ID, "follow-synthetic").is_displayed())
            driver.find_element(By.ID, "follow-synthetic").click()
            wait.until(lambda d: status(d).startswith("Ingested"))
            assert f"the gallery holds {expected['tracks']} track(s)" in status(driver)
            driver.find_element(By.CSS_SELECTOR, "#follow-query textarea").send_keys(FOLLOW_QUERY)
            driver.find_element(By.ID, "follow-find").click()
            wait.until(lambda d: "track(s) for" in status(d))
            assert status(driver).startswith(f"{len(expected['hits'])} track(s) for")
            hits = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#follow-hits img") or None)
            assert len(hits) == len(expected["hits"])
            hits[0].click()
            wait.until(lambda d: status(d).startswith("More like #1"))
            wait.until(
                lambda d: len(d.find_elements(By.CSS_SELECTOR, "#follow-like img")) == len(expected["like"])
            )
            rows = driver.find_elements(By.CSS_SELECTOR, "#follow-timeline .row")
            assert {row.get_attribute("data-camera") for row in rows} == expected["cameras"]
            marks = driver.find_elements(By.CSS_SELECTOR, "#follow-timeline .mark")
            assert len(marks) == len(expected["like"])
            links = [
                a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, "#follow-timeline a")
            ]
            assert len(links) == len(marks) and all("/gradio_api/file=" in h and "#t=" in h for h in links)
            first = expected["hits"][0]
            assert f"({first['camera']}, track {first['track']})" in status(driver)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            assert driver.save_screenshot(str(SCREENSHOT.with_name("app_follow.png")))
        finally:
            driver.quit()
    assert time.monotonic() - started < 90, "the follow flow took too long for a browser test"
