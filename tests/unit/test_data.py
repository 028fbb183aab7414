"""Loading [[datasets]] entries into Prompts, with real `datasets` on local files."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from grpo_core.config.loader import validate
from grpo_core.contract.errors import DataError
from grpo_core.data.prompts import common_columns, load_prompts
from grpo_core.modeling.models import load_tokenizer

ROWS = [
    {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)]
]

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 1,200 pens; 200 are sold. How many remain?", "answer": "1200 - 200 = 1000\n#### 1,000"},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(validate({"base_model": smollm2_dir}), smollm2_dir)


def cfg_with(datasets, **extra):
    return validate({"base_model": "unused/model", "datasets": datasets, **extra})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_jsonl_plain_prompts_keep_columns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    prompts = load_prompts(cfg_with([{"path": str(path)}], shuffle_dataset=False), tokenizer)
    assert [p.prompt for p in prompts] == [r["prompt"] for r in ROWS]
    assert prompts[1].columns == {"answer": "7"}
    assert prompts[1].prompt_ids == tokenizer("What is 3 + 4?", add_special_tokens=False)["input_ids"]
    assert [p.index for p in prompts] == list(range(len(ROWS)))
    assert common_columns(prompts) == {"answer"}


def test_csv_parquet_and_saved_dir(tmp_path, tokenizer):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(ROWS)
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    DatasetDict({"train": ds.select(range(2)), "test": ds.select(range(2, 6))}).save_to_disk(str(tmp_path / "saved"))
    cfg = cfg_with(
        [
            {"path": str(tmp_path / "d.csv")},
            {"path": str(tmp_path / "d.parquet")},
            {"path": str(tmp_path / "saved"), "split": "test"},
            {"path": str(tmp_path / "saved"), "split": "test[:1]"},
        ],
        shuffle_dataset=False,
    )
    prompts = load_prompts(cfg, tokenizer)
    assert len(prompts) == 6 + 6 + 4 + 1
    assert [p.prompt for p in prompts[12:]] == [ROWS[2]["prompt"], *[r["prompt"] for r in ROWS[3:6]], ROWS[2]["prompt"]]
    # CSV infers numbers: the answer column arrives as an int there.
    assert prompts[0].columns["answer"] == 3 and prompts[6].columns["answer"] == "3"


def test_conversational_prompts_get_the_chat_template(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    prompts = load_prompts(cfg_with([{"path": str(path)}]), tokenizer)
    expected = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompts[0].prompt_ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    assert prompts[0].is_conversational and prompts[0].columns == {"answer": "4"}


def test_chat_template_kwargs_reach_the_template(tmp_path, smollm2_dir):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    cfg = cfg_with(
        [{"path": str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hey"}]}]))}],
        chat_template=template,
        trl={"chat_template_kwargs": {"shout": True}},
    )
    tok = load_tokenizer(cfg.model_copy(update={"base_model": smollm2_dir}), smollm2_dir)
    assert tok.decode(load_prompts(cfg, tok)[0].prompt_ids) == "hey!!"


def test_shuffle_is_seeded(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS * 3)
    order = lambda seed: [p.prompt for p in load_prompts(cfg_with([{"path": str(path)}], seed=seed), tokenizer)]  # noqa: E731
    assert order(1) == order(1)
    assert order(1) != order(2)
    assert sorted(order(1)) == sorted(r["prompt"] for r in ROWS * 3)
    assert order(1) != [r["prompt"] for r in ROWS * 3]


def test_long_prompts_dropped_with_warning(tmp_path, tokenizer):
    rows = ROWS[:3] + [{"prompt": "word " * 200, "answer": "0"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.warns(UserWarning, match="dropped 1 of 4 prompts longer than trl.max_prompt_length = 50"):
        prompts = load_prompts(cfg_with([{"path": str(path)}], trl={"max_prompt_length": 50}), tokenizer)
    assert len(prompts) == 3 and all(len(p.prompt_ids) <= 50 for p in prompts)
    with pytest.raises(DataError, match="every prompt is longer"), pytest.warns(UserWarning, match="dropped 4 of 4"):
        load_prompts(cfg_with([{"path": str(path)}], trl={"max_prompt_length": 2}), tokenizer)


def test_gsm8k_transform_from_the_reference(in_tmp, tokenizer):
    write_jsonl(in_tmp / "gsm8k.jsonl", GSM8K_ROWS)
    (in_tmp / "gsm_rewards.py").write_text(
        textwrap.dedent("""
        def prompt_transform(cfg, *args, **kwargs):
            def transform_fn(example, tokenizer=None):
                label = example["answer"].split("####")[-1].strip().replace(",", "")
                return {
                    "prompt": [
                        {"role": "system", "content": "Solve the math problem."},
                        {"role": "user", "content": example["question"]},
                    ],
                    "answer": label,
                    "saw_tokenizer": tokenizer is not None,
                }
            return transform_fn, {"remove_columns": ["question"]}
    """)
    )
    cfg = cfg_with([{"path": "gsm8k.jsonl", "type": "gsm_rewards.prompt_transform"}], shuffle_dataset=False)
    prompts = load_prompts(cfg, tokenizer)
    assert [p.columns for p in prompts] == [
        {"answer": "7", "saw_tokenizer": True},
        {"answer": "1000", "saw_tokenizer": True},
    ]
    assert prompts[0].prompt[1]["content"].startswith("Tom has 3 apples")
    text = tokenizer.decode(prompts[0].prompt_ids)
    assert text.startswith("<|im_start|>system\nSolve the math problem.") and text.endswith("<|im_start|>assistant\n")


def test_transform_in_nested_package_without_tuple(in_tmp, tokenizer):
    pkg = in_tmp / "my_data" / "sub"
    pkg.mkdir(parents=True)
    (in_tmp / "my_data" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "shaping.py").write_text(
        textwrap.dedent("""
        def to_prompt(cfg):
            seed = cfg.seed
            def fn(example):
                return {"prompt": "Q: " + example["q"], "seed": seed}
            return fn
    """)
    )
    write_jsonl(in_tmp / "q.jsonl", [{"q": "one"}, {"q": "two"}])
    cfg = cfg_with([{"path": "q.jsonl", "type": "my_data.sub.shaping.to_prompt"}], shuffle_dataset=False, seed=7)
    prompts = load_prompts(cfg, tokenizer)
    assert [p.prompt for p in prompts] == ["Q: one", "Q: two"]
    assert prompts[0].columns == {"q": "one", "seed": 7}


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("missing_file", r"datasets\[0\] \(path 'nope.jsonl'\): no such file"),
        ("empty", r"datasets\[0\].*is empty"),
        ("no_prompt", r"no 'prompt' column \(columns: \['question'\]\).*transform"),
        ("bad_import", r"cannot import transform type 'no_such_mod.fn'"),
        ("bad_remove", r"removes column\(s\) \['nope'\]"),
        ("hub_offline", r"datasets\[0\] \(path 'someone/some-dataset'\): could not load.*local copy"),
        ("no_entries", r"no \[\[datasets\]\] entry"),
    ],
)
def test_data_errors_name_entry_and_fix(in_tmp, tokenizer, setup, match):
    write_jsonl(in_tmp / "q.jsonl", [{"question": "x"}])
    (in_tmp / "empty.jsonl").write_text("")
    (in_tmp / "remover.py").write_text(
        "def t(cfg):\n    return (lambda ex: {'prompt': ex['question']}), {'remove_columns': ['nope']}\n"
    )
    entries = {
        "missing_file": [{"path": "nope.jsonl"}],
        "empty": [{"path": "empty.jsonl"}],
        "no_prompt": [{"path": "q.jsonl"}],
        "bad_import": [{"path": "q.jsonl", "type": "no_such_mod.fn"}],
        "bad_remove": [{"path": "q.jsonl", "type": "remover.t"}],
        "hub_offline": [{"path": "someone/some-dataset"}],
        "no_entries": [],
    }[setup]
    with pytest.raises(DataError, match=match):
        load_prompts(cfg_with(entries), tokenizer)


def test_transform_modules_do_not_leak(in_tmp):
    # Guard for the tests above: each wrote its own module names.
    assert "no_such_mod" not in sys.modules
