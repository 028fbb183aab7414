"""The issue's four broken inputs through the real ``grpo run``: each ends in
one ``error:`` line naming the file, row or setting with the fix, exit code
2, no traceback, before the model loads, and every file already written is
left as it was.

* a checkpoint whose ``model/adapter_model.safetensors`` was cut short
  (once: a safetensors ``invalid header length`` traceback);
* resuming a ``lora_r = 4`` checkpoint with ``lora_r = 16`` (once: a
  ``state_dict`` size-mismatch traceback after the model loaded);
* a row whose question is the number 12345, through the reference guide's
  GSM8K transform (once: a ``TypeError`` inside the chat template);
* a JSON Lines file with one malformed line (once: "check `split`, `name`
  and `data_files`", the wrong fix).

The checkpoints come from one real run of the tiny model (tests/tiny_model.py:
what is checked is the plumbing, not learning). The generated variants of
each reader run in process: tests/unit/test_bad_checkpoints.py,
tests/unit/test_bad_datasets.py, tests/unit/test_bad_configs.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import Runner, assert_clean_failure, assert_no_model_loaded, populate, write_dataset

GSM8K_TRANSFORM = """
def prompt_transform(cfg, *args, **kwargs):
    def to_prompt(example, tokenizer=None):
        final = example["answer"].split("####")[-1].strip().replace(",", "")
        return {"prompt": [{"role": "user", "content": example["question"]}], "answer": final}

    return to_prompt, {"remove_columns": ["question"]}
"""


def digest(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in root.rglob("*") if f.is_file()
    }


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[Runner]:
    """One real run (LoRA r=4, alpha 8) that saved checkpoint-1 and checkpoint-2."""
    root = tmp_path_factory.mktemp("inputs")
    runner = Runner(populate(root / "work"), tiny_model_dir)
    try:
        code, output = runner.run(runner.config(max_steps=2, save_steps=1))
        assert code == 0, output[-6000:]
        yield runner
    finally:
        runner.close()


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, output[-6000:]
    return lines[0]


def test_a_checkpoint_whose_adapter_was_cut_short_is_named(saved_run: Runner, tmp_path: Path) -> None:
    checkpoint = shutil.copytree(saved_run.workdir / "out" / "checkpoint-2", tmp_path / "copied" / "checkpoint-2")
    adapter = checkpoint / "model" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])  # an interrupted copy
    before = digest(tmp_path / "copied"), digest(saved_run.workdir / "out")
    config = saved_run.config(
        "cut.toml", max_steps=3, resume_from_checkpoint=str(checkpoint), output_dir=str(tmp_path / "out")
    )
    code, output = saved_run.run(config)
    assert_clean_failure(code, output)
    line = one_error_line(output)
    assert str(adapter) in line and "cut short" in line and "Resume from another checkpoint" in line, line
    assert "SafetensorError" not in output
    assert_no_model_loaded(output)
    assert (digest(tmp_path / "copied"), digest(saved_run.workdir / "out")) == before


def test_resuming_with_another_lora_rank_names_the_difference(saved_run: Runner, tmp_path: Path) -> None:
    checkpoint = saved_run.workdir / "out" / "checkpoint-1"
    before = digest(checkpoint)
    config = saved_run.config(
        "rank.toml",
        max_steps=3,
        lora_r=16,
        lora_alpha=16,
        resume_from_checkpoint=str(checkpoint),
        output_dir=str(tmp_path / "out"),
    )
    code, output = saved_run.run(config)
    assert_clean_failure(code, output)
    line = one_error_line(output)
    assert f'resume_from_checkpoint = "{checkpoint}" does not match this config' in line, line
    assert "lora_r = 4, this config has 16. Set lora_r = 4" in line, line
    assert "lora_alpha = 8, this config has 16. Set lora_alpha = 8" in line, line
    assert "state_dict" not in output
    assert_no_model_loaded(output)
    assert digest(checkpoint) == before


# ~15 s: a full resume; the old format is read in process by test_bad_checkpoints and test_checkpoint_safety
@pytest.mark.extended
def test_a_checkpoint_from_before_the_record_still_resumes(saved_run: Runner, tmp_path: Path) -> None:
    old = shutil.copytree(saved_run.workdir / "out" / "checkpoint-1", tmp_path / "old" / "checkpoint-1")
    (old / "manifest.json").unlink()
    config = saved_run.config(
        "old.toml", max_steps=2, resume_from_checkpoint=str(old), output_dir=str(tmp_path / "out")
    )
    code, output = saved_run.run(config)
    assert code == 0, output[-6000:]
    assert f"resumed from {old} at step 1" in output
    assert json.loads((tmp_path / "out" / "checkpoint-2" / "manifest.json").read_text())["made_with"]["lora_r"] == 4


def test_a_question_that_is_a_number_names_its_row_and_column(runner: Runner) -> None:
    (runner.workdir / "gsm8k_transform.py").write_text(GSM8K_TRANSFORM, encoding="utf-8")
    rows = [{"question": f"What is {i} + 1?", "answer": f"It is {i + 1}.\n#### {i + 1}"} for i in range(6)]
    rows[3]["question"] = 12345
    data = runner.workdir / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = runner.config(datasets=[{"path": str(data), "type": "gsm8k_transform.prompt_transform"}])
    code, output = runner.run(config)
    assert_clean_failure(code, output)
    line = one_error_line(output)
    assert "row 3, column 'prompt'" in line and "content 12345 of type int, not text" in line, line
    assert "It comes from column 'question'" in line and "gsm8k_transform.prompt_transform" in line, line
    assert "can only concatenate" not in output
    assert_no_model_loaded(output)


def test_a_malformed_json_lines_line_names_the_file_and_the_line(runner: Runner) -> None:
    data = write_dataset(runner.workdir / "broken.jsonl", rows=8)
    lines = data.read_text(encoding="utf-8").splitlines()
    lines.insert(4, '{"prompt": "Q: What is 2 + 2?\\nA:", "answer": ')  # line 5: cut mid-row
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, output = runner.run(runner.config(datasets=[{"path": str(data)}]))
    assert_clean_failure(code, output)
    line = one_error_line(output)
    assert f"{data}: line 5 is not valid JSON" in line and "Fix or delete that line" in line, line
    assert "check `split`" not in line and "DatasetGenerationError" not in line
    assert_no_model_loaded(output)
