"""Fixtures pytest injects by name, and the slow tier (the shared helpers and tiny configs live in fixtures.py)."""

import ast
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import convert_tiny_clip, save_eval_model, synthetic_eval_set, tiny_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Each pytest-xdist worker gets its share of the cores (two workers on two cores: one thread each, no fight).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture
def config():
    return tiny_config()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast and does not fight the other test processes for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def faiss_one_thread():
    """One torch and one faiss thread (modules: ``pytestmark = pytest.mark.usefixtures("faiss_one_thread")``): on a
    busy 2-core CPU, idle torch OpenMP workers spinning beside faiss's training make building a small index 30x
    slower (1 s -> 30 s)."""
    faiss = pytest.importorskip("faiss")
    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(threads[0])
    faiss.omp_set_num_threads(threads[1])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The evaluator tests' 16-identity synthetic set (`fixtures.synthetic_eval_set`), once per module."""
    return synthetic_eval_set(tmp_path_factory.mktemp("synthetic_eval"))


@pytest.fixture
def tiny_disk(tmp_path):
    """A factory of tmpfs mounts of a given size in KiB (skipped where mounting is not permitted)."""
    mounts = []

    def make(kib: int) -> Path:
        mount = tmp_path / f"disk{len(mounts)}"
        mount.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here ({result.stderr.strip()}); the ENOSPC-injection tests still run"
            )
        mounts.append(mount)
        return mount

    yield make
    for mount in mounts:
        subprocess.run(["umount", "-l", str(mount)], check=False)  # lazy: a loaded model may still map a file


@pytest.fixture(scope="module")
def clip_init(tmp_path_factory) -> Path:
    """A transformers CLIP converted to TAG-CLIP at its own 32x32 grid (`fixtures.convert_tiny_clip`)."""
    return convert_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The evaluator tests' saved tiny TAG-CLIP (`fixtures.save_eval_model`), once per module."""
    return save_eval_model(tmp_path_factory.mktemp("model"))


# Test tiers. The edit loop runs `python -m pytest -m "not slow"` (unit tests on tiny models); CI and the
# README's command run everything, fast tests first (a failure shows early). Every slow test carries an explicit
# `@pytest.mark.slow`: one that starts a process, runs a whole training or command in-process, compiles or builds
# a wheel. Two nets catch a missing mark, and neither adds it: a test fails when the rules below call it slow and
# it is not marked (it starts a process: it, or a fixture or helper it uses, names one of SPAWNS, helpers from
# fixtures.py followed; it runs a whole job: SLOW_FIXTURES, SLOW_TESTS; or it sits in SLOW_MODULES); and a fast
# test that starts a training or a launcher anyway fails (`_fast_tests_start_no_training`).
# names that start a process: subprocess.*, run_python, sys.executable, (torch.)multiprocessing
SPAWNS = frozenset({"subprocess", "run_python", "executable", "multiprocessing"})
# torch.compile, ONNX export, wheel builds
SLOW_MODULES = frozenset({"test_compile", "test_export", "test_packaging"})
# (module, fixture): the in-process ViSA training run that test_train_reid's end-to-end tests share
SLOW_FIXTURES = frozenset({("test_train_reid", "run")})
# (module, test): end-to-end runs started in this process (a dataset or a model folder in, files out; the
# ablation harness launches trainings itself; whole benchmark scripts; index builds interrupted and resumed)
# and DataLoader worker processes
SLOW_TESTS = frozenset(
    {
        ("test_evaluate", "test_cli_writes_json_grid_and_is_deterministic"),
        ("test_dtg", "test_cli_tiny_vlm_dataset_carries_views"),
        ("test_ablate", "test_micro_study_writes_table_json_plot_and_resumes"),
        ("test_ablate", "test_pretrained_clip_converts_and_loads_as_a_fine_tuning_init"),
        ("test_clip_pretraining", "test_the_loop_gives_the_losses_and_weights_of_the_hand_written_loop"),
        ("test_clip_pretraining", "test_pre_training_stopped_mid_epoch_resumes_step_exact"),
        ("test_clip_pretraining", "test_a_killed_pre_training_phase_continues_and_a_finished_one_is_reused"),
        ("test_encode_loading", "test_workers_and_shards_give_the_same_rows"),
        ("test_train", "test_persistent_loader_workers_augment_as_the_main_process"),
        ("test_encode_loading", "test_reid_encoding_with_workers_equals_one_batch"),
        ("test_index_cli", "test_bf16_autocast_and_dataloader_workers"),
        ("test_index_cli", "test_missing_or_truncated_shard_is_re_encoded_not_trusted"),
        ("test_index_cli", "test_interrupted_index_resumes_byte_identically"),
        ("test_benchmarks_smoke", "test_bench_search_quick"),
        ("test_benchmarks_smoke", "test_bench_towers_quick"),
        ("test_benchmarks_smoke", "test_bench_towers_quick_visa"),
        ("test_benchmarks_smoke", "test_bench_train_step_quick"),
        # bisection to a 1e-6 tie under CPU bf16 (emulated without AVX512-BF16): 85 s alone, 900 s under load
        ("test_bf16_tse", "test_near_tied_image_keeps_fp32_tokens_under_bf16"),
    }
)
TESTS_DIR = Path(__file__).resolve().parent
# tests/<area>/ mirror the package; a test may import helpers of a test module in another area
TEST_AREAS = sorted(
    d
    for d in TESTS_DIR.iterdir()
    if d.is_dir() and (d / "__init__.py").exists() is False and any(d.glob("test_*.py"))
)
sys.path[:0] = [str(d) for d in TEST_AREAS if str(d) not in sys.path]


def test_module_file(name: str) -> Path | None:
    """The file of test module ``name`` in any area, or of the shared ``fixtures`` (None when there is none)."""
    if name == "fixtures":
        return TESTS_DIR / "fixtures.py"
    return next((d / f"{name}.py" for d in TEST_AREAS if (d / f"{name}.py").is_file()), None)


def imported_spawners(tree: ast.Module, seen: frozenset[str] = frozenset()) -> set[str]:
    """Names a test module imports from a sibling module (``from test_train import run_train``) that spawn."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module not in seen:
            sibling = test_module_file(node.module)
            if sibling is not None:
                spawning = spawning_functions(sibling.read_text(), seen | {node.module})
                found |= {alias.asname or alias.name for alias in node.names if alias.name in spawning}
    return found


def spawning_functions(source: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """Module-level functions of `source` that start a process, directly or through each other (or through
    a helper imported from a sibling test module)."""
    tree = ast.parse(source)
    spawns = SPAWNS | imported_spawners(tree, seen)
    uses = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes = list(ast.walk(node))
            names = {n.id for n in nodes if isinstance(n, ast.Name)}
            uses[node.name] = names | {n.attr for n in nodes if isinstance(n, ast.Attribute)}
    spawning = {name for name, used in uses.items() if used & spawns}
    while grown := {name for name, used in uses.items() if used & spawning} - spawning:
        spawning |= grown
    return spawning


def is_slow(module_name: str, test_name: str, fixtures: set[str], spawning: set[str]) -> bool:
    if module_name in SLOW_MODULES or (module_name, test_name) in SLOW_TESTS:
        return True
    if {(module_name, fixture) for fixture in fixtures} & SLOW_FIXTURES:
        return True
    return test_name in spawning or bool(fixtures & spawning)


# tests the rules above call slow that carry no `@pytest.mark.slow`: each fails (`_slow_tests_are_marked`); the
# mark is never added for them
UNMARKED_SLOW: set[str] = set()


@pytest.fixture(autouse=True)
def _slow_tests_are_marked(request):
    """A test that starts a process (or is slow by the rules above) without `@pytest.mark.slow` fails."""
    if request.node.nodeid in UNMARKED_SLOW:
        pytest.fail(
            f"{request.node.nodeid} starts a process (or is slow by the rules of tests/conftest.py) "
            "but is not marked @pytest.mark.slow",
            pytrace=False,
        )


def pytest_collection_modifyitems(config, items):
    cache: dict[str, set[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        name = module.__name__.rpartition(".")[2]
        if name not in cache:
            cache[name] = spawning_functions(inspect.getsource(module))
        if is_slow(name, item.originalname, set(item.fixturenames), cache[name]):
            if item.get_closest_marker("slow") is None:
                UNMARKED_SLOW.add(item.nodeid)
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: fast tests first


TRAINING_COMMANDS = (
    "train.py",
    "train_reid.py",
    "training.train",
    "training.train_reid",
    "accelerate",
    "torchrun",
)


def starts_training(args) -> bool:
    """Whether a ``Popen`` command line runs a training script or a distributed launcher."""
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return any(os.fsdecode(word).endswith(TRAINING_COMMANDS) for word in words)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_training(request, monkeypatch):
    """A test of the fast tier that starts a training or a launcher fails: the tier marking missed it."""
    if request.node.get_closest_marker("slow") is not None:
        return
    real_init = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        if starts_training(args):
            raise RuntimeError(f"{request.node.nodeid} starts a training ({args}) but is not marked slow")
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
