"""Config and data faults through ``grpo run``: each is one clear message
naming the key or file and the fix, exit code 2, no traceback, and it comes
before the model loads (grpo logs "loading model from" right before it does).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_harness import Runner, assert_clean_failure, assert_no_model_loaded, metrics, write_dataset


@pytest.mark.parametrize(
    ("fault", "fragments"),
    [
        ("malformed_toml", ["config.toml is not valid TOML", "line"]),
        ("unknown_key", ["unknown key 'trl.num_generatons'", "did you mean 'trl.num_generations'?"]),
        ("wrong_type", ["'micro_batch_size'", "valid integer", '(got "four")']),
    ],
    ids=["malformed_toml", "unknown_key", "wrong_type"],
)
def test_config_fault_is_one_clear_error(runner: Runner, fault: str, fragments: list[str]) -> None:
    config = runner.config()
    sets: list[str] = []
    if fault == "malformed_toml":
        config.write_text(config.read_text() + "\n[trl\nnum_generations = 2\n")
    elif fault == "unknown_key":
        sets = ["trl.num_generatons=2"]
    else:
        sets = ['micro_batch_size="four"']
    code, output = runner.run(config, *sets)
    assert_clean_failure(code, output)
    for fragment in fragments:
        assert fragment in output, output
    assert output.count("error:") == 1, output
    assert_no_model_loaded(output)


def _empty_jsonl(workdir: Path) -> Path:
    path = workdir / "empty.jsonl"
    path.write_text("")
    return path


def _header_only_csv(workdir: Path) -> Path:
    path = workdir / "empty.csv"
    path.write_text("prompt,answer\n")
    return path


def _without_answer(workdir: Path) -> Path:
    return write_dataset(workdir / "no_answer.jsonl", with_answer=False)


def _all_too_long(workdir: Path) -> Path:
    return write_dataset(workdir / "long.jsonl", rows=0, long_rows=3)


@pytest.mark.parametrize(
    ("fault", "make", "fragments"),
    [
        (
            "missing_file",
            lambda w: w / "absent.jsonl",
            ["datasets[0]", "absent.jsonl", "no such file or directory", "Fix `path`"],
        ),
        ("empty_file", _empty_jsonl, ["datasets[0]", "empty.jsonl", "the dataset is empty", "Fix `path`"]),
        (
            "no_rows",
            _header_only_csv,
            ["datasets[0]", "empty.csv", "the dataset is empty (the file", "has no rows", "Fix `path`"],
        ),
        (
            "missing_column",
            _without_answer,
            [
                "reward function 'good' needs column(s) ['answer']",
                "The dataset has:",
                "remove_columns",
                "give the parameters a default",
            ],
        ),
        (
            "every_prompt_too_long",
            _all_too_long,
            ["every prompt is longer than trl.max_prompt_length = 128 tokens", "raise it (or sequence_len)"],
        ),
    ],
    ids=["missing_file", "empty_file", "no_rows", "missing_column", "every_prompt_too_long"],
)
def test_data_fault_is_reported_before_the_model_loads(runner: Runner, fault: str, make, fragments: list[str]) -> None:
    dataset = make(runner.workdir)
    code, output = runner.run(runner.config(datasets=[{"path": str(dataset)}]))
    assert_clean_failure(code, output)
    for fragment in fragments:
        assert fragment in output, output
    assert_no_model_loaded(output)
    assert not (runner.workdir / "out" / "metrics.jsonl").exists()


def test_prompts_longer_than_sequence_len_are_dropped_with_a_warning(runner: Runner) -> None:
    dataset = write_dataset(runner.workdir / "mixed.jsonl", rows=8, long_rows=2)
    code, output = runner.run(runner.config(datasets=[{"path": str(dataset)}], max_steps=1))
    assert code == 0, output[-6000:]
    warning = "warning: dropped 2 of 10 prompts longer than trl.max_prompt_length = 128 tokens"
    assert warning in output, output
    assert "sequence_len" in output.split(warning, 1)[1].splitlines()[0]  # the fix is on the same line
    assert "UserWarning" not in output  # grpo's format, not Python's with a source line
    assert output.index(warning) < output.index("loading model from")  # reported before the model loads
    assert [r["step"] for r in metrics(runner.workdir / "out")] == [1]
    # every prompt the run sampled fits: none of the 900-token ones got through
    tokens = [r["num_tokens"] for r in metrics(runner.workdir / "out")]
    assert tokens and all(t <= 4 * (128 + 8) for t in tokens), json.dumps(tokens)
