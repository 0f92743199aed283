"""Bad loader settings of the evaluation commands are clear errors, not a ZeroDivisionError deep in a DataLoader."""

import argparse

import pytest

from modeling_tagclip.evaluation import text_retrieval
from modeling_tagclip.evaluation.arguments import parse_reid_args, parse_retrieval_args
from modeling_tagclip.flags import nonnegative_int, positive_int, torch_device

BASE = ["--model", "m", "--data", "d"]


@pytest.mark.parametrize("parse", [parse_retrieval_args, parse_reid_args])
@pytest.mark.parametrize(
    "flag, value",
    [("--batch-size", "0"), ("--batch-size", "-4"), ("--workers", "-1"), ("--num-workers", "-1")],
)
def test_eval_clis_refuse_bad_loader_numbers(parse, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse([*BASE, flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    shown = {"--num-workers": "--workers"}.get(flag, flag)  # an old name: the error names the flag help shows
    assert f"argument {shown}:" in err and repr(value) in err


def test_eval_clis_keep_valid_numbers():
    args = parse_retrieval_args([*BASE, "--batch_size", "8", "--num_workers", "0"])
    assert (args.batch_size, args.workers) == (8, 0)
    args = parse_reid_args([*BASE, "--batch-size", "1", "--workers", "3"])
    assert (args.batch_size, args.workers) == (1, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "reid", "--rerank"], "--rerank is a flag of --task reid, not of --task retrieval"),
        (["--split", "val"], "--split is a flag of --task retrieval, not of --task reid"),
    ],
)
def test_a_flag_of_the_other_task_is_a_usage_error(argv, message, capsys):
    parse = parse_retrieval_args if "--task" in argv else parse_reid_args
    with pytest.raises(SystemExit) as exit_info:
        parse([*BASE, *[a for a in argv if a not in ("--task", "reid")]])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"tagclip eval: error: {message}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"text_batch_size": 0}, "text_batch_size must be an integer >= 1, got 0"),
        ({"batch_size": 2.5}, "batch_size must be an integer >= 1, got 2.5"),
        ({"num_workers": -1}, "num_workers must be an integer >= 0, got -1"),
    ],
)
def test_run_retrieval_refuses_bad_loader_numbers_before_encoding(kwargs, message):
    from datasets import Dataset

    dataset = Dataset.from_dict(
        {"image_path": ["a.png"], "person_id": [1], "captions": [["a man"]], "view": [0]}
    )
    with pytest.raises(ValueError, match=message):  # the model is never touched: None would fail later
        text_retrieval.run_retrieval(None, None, dataset, **kwargs)


def test_argparse_types():
    assert positive_int("3") == 3 and nonnegative_int("0") == 0
    for bad in ("0", "-1", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            positive_int(bad)
    for bad in ("-1", "2.0", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="non-negative integer"):
            nonnegative_int(bad)


@pytest.mark.parametrize("parse", [parse_retrieval_args, parse_reid_args])
def test_eval_clis_refuse_a_device_this_machine_lacks(parse, capsys):
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    with pytest.raises(SystemExit) as exit_info:
        parse([*BASE, "--device", missing])
    assert exit_info.value.code == 2
    assert (
        f"'{missing}': this machine has {torch.cuda.device_count()} cuda device(s)" in capsys.readouterr().err
    )
    assert parse([*BASE, "--device", "cpu"]).device == "cpu"


def test_torch_device_type():
    assert torch_device("cpu") == "cpu"
    for bad, message in (("gpu0", "not a torch device"), ("cuda:x", "not a torch device")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            torch_device(bad)
