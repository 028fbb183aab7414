"""``grpo config check`` means what it says (issue #48): each config the
issue found passing although ``grpo run`` refuses it is now an error (exit
2) or a named warning, the last line says ``OK``, ``OK with N warnings`` or
the errors, ``--import`` runs the imports, and TRL users are told where
grpo's defaults and names differ.

In process and fast: the command runs through ``grpo_core.interface.cli.main``
(the console script's function) with its output captured; user modules are
small files in a temporary folder. Nothing loads a model.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError
from grpo_core.host.plugin_host import PluginHost
from grpo_core.interface import cli, cli_common
from grpo_core.validation.run_check import check_run_config

REPO = Path(__file__).resolve().parents[2]

REWARDS = "def accuracy_reward(completions, **kw):\n    return [0.0] * len(completions)\n"
TOOLS = (
    'def calculate(expression: str) -> str:\n    """Evaluate.\n\n    Args:\n        expression: it\n    """\n'
    '    return "0"\n'
)
BASE = """base_model = "org/model"
micro_batch_size = 8

[[datasets]]
path = "org/data"

[trl]
reward_funcs = ["{module}.accuracy_reward"]
"""


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Path:
    """A folder with a rewards and a tools module (named for the test, so
    nothing imported by one test is found by another), as the working
    directory; sys.path and the CLI's printed-once warnings restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(cli_common, "_warned", set())
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:10]
    (tmp_path / f"rw_{tag}.py").write_text(REWARDS, encoding="utf-8")
    (tmp_path / f"tl_{tag}.py").write_text(TOOLS, encoding="utf-8")
    (tmp_path / "c.toml").write_text(BASE.format(module=f"rw_{tag}"), encoding="utf-8")
    return tmp_path


def names(path: Path) -> tuple[str, str]:
    """The rewards and tools modules of :func:`here`."""
    return next(path.glob("rw_*.py")).stem, next(path.glob("tl_*.py")).stem


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``grpo config check c.toml ARGS`` in process: (exit code, stdout, stderr)."""
    code = cli.main(["config", "check", "c.toml", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def host() -> PluginHost:
    plugins = PluginHost()
    plugins.load_always_on()
    return plugins


# ------------------------------------------------------------ what the issue found passing


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        (
            'trl.reward_funcs=["{rw}.accuracy_rewrd"]',
            [
                "trl.reward_funcs[0] = '{rw}.accuracy_rewrd'",
                "defines no top-level 'accuracy_rewrd'",
                "did you mean '{rw}.accuracy_reward'?",
            ],
        ),
        (
            'trl.reward_funcs=["last_numbr_match"]',
            ["no installed package registers a reward function of that name (did you mean 'last_number_match'?)"],
        ),
        (
            'trl.reward_funcs=["nomodule.accuracy"]',
            ["trl.reward_funcs[0] = 'nomodule.accuracy'", "no module 'nomodule'"],
        ),
        (
            'trl.tools=["{tl}.calculat"]',
            ["trl.tools[0] = '{tl}.calculat'", "did you mean '{tl}.calculate'?"],
        ),
        (  # judged with what output_dir holds (validation/output_dir.py)
            'resume_from_checkpoint="runs/checkpoint-5"',
            ["resume_from_checkpoint: runs/checkpoint-5 is not a complete grpo checkpoint"],
        ),
        ('base_model="./no-model"', ["base_model: './no-model' does not exist"]),
        ('base_model="weights/model.gguf"', ["GGUF file not found"]),
        ('datasets[0].path="data/train.jsonl"', ["datasets[0].path 'data/train.jsonl' does not exist"]),
        ('deepspeed="ds.json"', ["ds.json"]),
        (
            "plugins.toolz={{format='json'}}",
            ["[plugins.toolz]", "no installed package publishes", "did you mean [plugins.tools]?"],
        ),
    ],
)
def test_each_failing_case_of_the_issue_exits_2_naming_key_and_fix(
    here: Path, capsys: pytest.CaptureFixture[str], override: str, fragments: list[str]
) -> None:
    rw, tl = names(here)
    code, out, err = check(capsys, "--set", override.format(rw=rw, tl=tl))
    assert code == 2, out + err
    assert "Traceback" not in err and "OK" not in out
    assert err.strip().splitlines()[0].startswith("error:")
    for fragment in fragments:
        assert fragment.format(rw=rw, tl=tl) in err, err


def test_the_good_config_says_ok_and_a_warning_is_counted_on_the_last_line(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = check(capsys)
    assert code == 0, err
    assert out.rstrip().splitlines()[-1] == "c.toml: OK"
    code, out, err = check(capsys, "--set", "plugins.openenv={max_restarts=1}")  # published, unused: a warning
    assert code == 0, err
    assert out.rstrip().splitlines()[-1] == "c.toml: OK with 1 warning"
    assert "[plugins.openenv] configures 'openenv', which this run does not use" in err
    code, out, err = check(
        capsys, "--set", "plugins.openenv={max_restarts=1}", "--set", "save_steps=0", "--set", "max_steps=200"
    )
    assert out.rstrip().splitlines()[-1] == "c.toml: OK with 2 warnings"


def test_a_tracker_whose_package_is_missing_is_an_error(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    cfg = validate({**minimal(here), "report_to": ["trackio"]})
    with pytest.raises(ConfigError, match=r"report_to = 'trackio' needs the 'trackio' package: pip install trackio"):
        check_run_config(cfg, host())
    # "all" means the trackers that can start here: trackio is left out, not an error
    assert "trackio" not in check_run_config(validate({**minimal(here), "report_to": ["all"]}), host())


def minimal(here: Path, **extra: Any) -> dict[str, Any]:
    rw, _ = names(here)
    return {
        "base_model": "org/model",
        "micro_batch_size": 8,
        "datasets": [{"path": "org/data"}],
        "trl": {"reward_funcs": [f"{rw}.accuracy_reward"], **extra.pop("trl", {})},
        **extra,
    }


# ------------------------------------------------------------ datasets: data_files and hub ids


def test_data_files_must_match_a_file_where_datasets_will_look(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (here / "rows" / "train").mkdir(parents=True)
    (here / "rows" / "train" / "part-0.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (here / "local.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    # a folder's data_files are relative to the folder; globs as datasets takes them
    for found in ("train/part-0.jsonl", "train/*.jsonl", ["train/**/*.jsonl"]):
        check_run_config(validate(minimal(here, datasets=[{"path": "./rows", "data_files": found}])))
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.data_files: 'train/part-1\.jsonl' match no file in rows"):
        check_run_config(validate(minimal(here, datasets=[{"path": "./rows", "data_files": "train/part-1.jsonl"}])))
    # a packaged builder reads them from the working directory, or beside the config
    check_run_config(validate(minimal(here, datasets=[{"path": "json", "data_files": "local.jsonl"}])))
    with pytest.raises(ConfigError, match=r"test_datasets\[0\]\.data_files: 'test\.jsonl' match no file"):
        check_run_config(
            validate(minimal(here, test_datasets=[{"path": "json", "data_files": ["local.jsonl", "test.jsonl"]}]))
        )
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.path = 'csv' reads data_files, and none are given"):
        check_run_config(validate(minimal(here, datasets=[{"path": "csv"}])))
    elsewhere = here / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (here / "c.toml").write_text(
        (here / "c.toml").read_text().replace('path = "org/data"', 'path = "json"\ndata_files = "local.jsonl"')
    )
    assert cli.main(["config", "check", str(here / "c.toml")]) == 0  # anchored beside the config by the loader
    # a file is read as it is: data_files beside it would be ignored
    warnings = check_run_config(
        validate(minimal(here, datasets=[{"path": str(here / "local.jsonl"), "data_files": "x"}]))
    )
    assert any("datasets[0].data_files has no effect" in w for w in warnings), warnings


def test_a_hub_dataset_not_in_the_cache_warns_or_offline_is_an_error(
    here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(here / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(here / "prepared"))
    cfg = validate(minimal(here, datasets=[{"path": "someone/numbers"}]))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what tests/conftest.py sets for the whole session
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.path = 'someone/numbers' is a hub dataset that is not in"):
        check_run_config(cfg)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # datasets' own variable wins over the hub's
    warnings = check_run_config(cfg)
    assert [w for w in warnings if "someone/numbers" in w] == [
        "datasets[0].path = 'someone/numbers' is not a local file or folder nor in the hub cache: it will be fetched "
        "from the Hugging Face hub when the run starts (a misspelt name fails only then)."
    ]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (here / "prepared" / "someone___numbers").mkdir(parents=True)  # prepared by datasets on an earlier run
    assert not [w for w in check_run_config(cfg) if "someone/numbers" in w]
    (here / "hub" / "datasets--someone--Other-Set").mkdir(parents=True)  # downloaded by huggingface_hub
    check_run_config(validate(minimal(here, datasets=[{"path": "someone/Other-Set"}])))


def test_names_reading_cannot_rule_out_are_warnings_and_held_objects_are_found(here: Path) -> None:
    (here / "starry.py").write_text("from os.path import *\n", encoding="utf-8")
    (here / "lazy.py").write_text("def __getattr__(name):\n    raise AttributeError(name)\n", encoding="utf-8")
    (here / "guarded.py").write_text(
        "try:\n    import json\nexcept ImportError:\n    json = None\nif json:\n    def scored(completions, **kw):\n"
        "        return [0.0] * len(completions)\n",
        encoding="utf-8",
    )
    warnings = check_run_config(
        validate(minimal(here, trl={"reward_funcs": ["starry.join", "lazy.anything", "guarded.scored"]}))
    )
    assert sum("`grpo config check --import` imports it to be sure" in w for w in warnings) == 2, warnings
    assert not any("guarded.scored" in w for w in warnings)  # defined inside a top-level if: found by reading
    from grpo_core.host.script_objects import hold

    spec = hold(lambda completions, **kw: [0.0] * len(completions), "scripted")
    check_run_config(validate(minimal(here, trl={"reward_funcs": [spec]})))  # grpo.train's held objects


def test_import_runs_the_imports_and_reports_what_they_raise(
    here: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:10]
    (here / f"boom_{tag}.py").write_text(
        "raise RuntimeError('needs a GPU')\n\ndef r(completions, **kw):\n    return []\n"
    )
    (here / f"late_{tag}.py").write_text("from os.path import *\n")  # reading cannot rule 'made_later' out
    code, out, err = check(capsys, "--set", f'trl.reward_funcs=["boom_{tag}.r"]')
    assert code == 0 and f"boom_{tag}" not in sys.modules  # without --import nothing runs
    code, out, err = check(capsys, "--import", "--set", f'trl.reward_funcs=["boom_{tag}.r"]')
    assert code == 2 and f"importing 'boom_{tag}' failed: RuntimeError: needs a GPU" in err, err
    code, out, err = check(capsys, "--import", "--set", f'trl.reward_funcs=["late_{tag}.made_later"]')
    assert code == 2 and f"module 'late_{tag}'" in err and "has no 'made_later' after importing it" in err, err
    rw, _ = names(here)
    code, out, err = check(capsys, "--import")
    assert code == 0 and "(each imported: --import)" in out and rw in sys.modules


def test_help_promises_what_is_checked_and_what_is_not(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "check", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for promise in (
        "`OK`, `OK with N warnings`",
        "exit code 2",
        "--import",
        "Not checked",
        "[vllm] GPU placement",
        "GPUs this machine shows",
        "HF_HUB_OFFLINE",
    ):
        assert promise in text, promise
    assert "gets past wiring" not in text


def test_convert_help_keeps_the_table_names(capsys: pytest.CaptureFixture[str]) -> None:
    """Typer renders help as rich markup, which swallowed [trl], [vllm] and [[datasets]]."""
    assert cli.main(["config", "convert", "--help"]) == 0
    text = capsys.readouterr().out
    assert "`trl:` becomes [trl], `vllm:` [vllm]" in " ".join(text.split())
    assert "[[datasets]]" in text


def test_plugins_lists_what_each_implementation_does() -> None:
    listing = cli.list_plugins()
    builtins = [i for entry in listing.values() for i in entry["implementations"] if i["distribution"] == "grpo"]
    missing = [i["name"] for i in builtins if not i["summary"]]
    assert builtins and not missing, missing
    vllm = next(i for i in listing["rollout"]["implementations"] if i["name"] == "vllm")
    assert vllm["summary"] == "Generation on vLLM servers, managed by grpo or external."
    assert all("``" not in i["summary"] for i in builtins)  # plain text, one sentence


# ------------------------------------------------------------ GPU placement by process count


def placed(here: Path, **vllm: Any) -> Any:
    model = here / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    rw, _ = names(here)
    return validate(
        {
            "base_model": str(model),
            "adapter": "lora",
            "micro_batch_size": 8,
            "datasets": [{"path": "org/data"}],
            "vllm": vllm,
            "trl": {"use_vllm": True, "reward_funcs": [f"{rw}.accuracy_reward"]},
        }
    )


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This machine has no GPU: torch.cuda.device_count(), which the vLLM
    plugin's placement check reads, is faked to answer ``count``."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_gpu_placement_is_judged_for_the_process_count(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fake_gpus(monkeypatch, 8)  # enough for every index below: this test is about how they fit together
    plugins = host()
    check_run_config(placed(here, devices=[1]), plugins, num_processes=1)  # trainer on GPU 0, server on GPU 1
    with pytest.raises(ConfigError, match=r"the 2 training processes \(GPUs 0-1, one per local rank\) share GPU 1"):
        check_run_config(placed(here, devices=[1]), plugins, num_processes=2)
    check_run_config(placed(here, devices=[2]), plugins, num_processes=2)
    with pytest.raises(
        ConfigError, match="trainer_devices narrows the GPUs of one training process, but this run has 4"
    ):
        check_run_config(placed(here, devices=[4], trainer_devices=[0, 1, 2, 3]), plugins, num_processes=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 16 processes over 2 machines: 8 here
    with pytest.raises(ConfigError, match="the 8 training processes"):
        check_run_config(placed(here, devices=[7]), plugins, num_processes=16)


def test_gpu_indices_this_machine_does_not_have_are_refused(
    here: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    plugins = host()
    fake_gpus(monkeypatch, 2)  # a machine showing 2 GPUs (CUDA_VISIBLE_DEVICES=4,5): indices 0 and 1
    assert check_run_config(placed(here, devices=[1]), plugins, num_processes=1) == []
    with pytest.raises(
        ConfigError, match=r"\[vllm\] devices asks for GPU 2, but the machine shows 2 GPUs \(indices 0-1"
    ):
        check_run_config(placed(here, devices=[2]), plugins, num_processes=2)
    with pytest.raises(
        ConfigError, match=r"torch.cuda.device_count\(\) with CUDA_VISIBLE_DEVICES=4,5; --gpus N checks"
    ):
        check_run_config(placed(here, devices=[2]), plugins, num_processes=2)
    with pytest.raises(ConfigError, match=r"\[vllm\] trainer_devices asks for GPU 3, but the machine shows 2 GPUs"):
        check_run_config(placed(here, devices=[0], trainer_devices=[3]), plugins, num_processes=1)
    warnings = check_run_config(  # before a launch the 3 processes may be on several machines: a warning
        placed(here, devices=[1, 0], data_parallel_size=2, gpu_memory_utilization=0.2), plugins, num_processes=3
    )
    assert any(
        "3 training processes, each on the GPU of its local rank, but the machine shows 2 GPUs" in w for w in warnings
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # launched: 4 processes on this machine, known
    with pytest.raises(ConfigError, match=r"4 training processes on this machine \(LOCAL_WORLD_SIZE\) each train on"):
        check_run_config(validate(minimal(here)), plugins, num_processes=4)  # no vLLM: the core counts them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 processes over 2 machines: 2 here
    assert check_run_config(validate(minimal(here)), plugins, num_processes=4) == []
    monkeypatch.delenv("LOCAL_WORLD_SIZE")

    fake_gpus(monkeypatch, 0)  # no GPU (this machine as it is): not checked, and said so
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    warnings = check_run_config(placed(here, devices=[5]), plugins, num_processes=1)
    assert [w for w in warnings if "GPU" in w] == [
        "[vllm] devices / trainer_devices were not checked against real GPUs: this machine shows none "
        "(torch.cuda.device_count() with CUDA_VISIBLE_DEVICES unset; --gpus N checks for another machine). Only how "
        "they fit together was checked; `grpo run` on the GPU machine checks that each index exists there."
    ]
    assert check_run_config(placed(here), plugins, num_processes=1) == []  # nothing placed: nothing to say
    check_run_config(validate(minimal(here)), plugins, num_processes=4)  # CPU processes: nothing to count

    # --gpus N: the check is for another machine, whatever this one has
    (here / "c.toml").write_text((here / "c.toml").read_text() + "\n[vllm]\ndevices = [4]\n")
    code, out, err = check(capsys, "--set", "trl.use_vllm=true", "--gpus", "4")
    assert code == 2 and "[vllm] devices asks for GPU 4, but the machine shows 4 GPUs" in err, err
    assert "--gpus 4: the machine the check is for" in err
    code, out, err = check(capsys, "--set", "trl.use_vllm=true", "--gpus", "8")
    assert code == 0 and "not checked against real GPUs" not in err, err
    code, out, err = check(capsys, "--gpus", "8", "--num-processes", "16")
    assert code == 0 and "16 training processes, each on the GPU of its local rank, but the machine shows 8" in err
    assert "--gpus 8: the machine the check is for" in err and "OK with 1 warning" in out, (out, err)
    code, out, err = check(capsys, "--set", "trl.use_vllm=true")  # this machine again, after --gpus
    assert code == 0 and "not checked against real GPUs" in err, err


# ------------------------------------------------------------ defaults that protect


def test_periodic_checkpoints_are_on_by_default_and_a_long_run_without_them_warns(here: Path) -> None:
    cfg = validate(minimal(here))
    assert cfg.save_steps == 50
    assert check_run_config(cfg) == []
    for off in ({"save_steps": 0}, {"save_steps": 500}):
        warnings = check_run_config(validate(minimal(here, max_steps=200, **off)))
        assert any("no checkpoint before step 200" in w and "save_steps" in w for w in warnings), warnings
    assert check_run_config(validate(minimal(here, max_steps=40, save_steps=0))) == []  # a short run: nothing to lose


def test_colocate_memory_default_leaves_the_trainer_its_gpu(here: Path) -> None:
    server = validate(minimal(here, trl={"use_vllm": True}))
    colocate = validate(minimal(here, trl={"use_vllm": True, "vllm_mode": "colocate"}))
    mine = validate(
        minimal(here, vllm={"gpu_memory_utilization": 0.45}, trl={"use_vllm": True, "vllm_mode": "colocate"})
    )
    assert (server.vllm.gpu_memory_utilization, colocate.vllm.gpu_memory_utilization) == (0.85, 0.3)
    assert mine.vllm.gpu_memory_utilization == 0.45
    assert "gpu_memory_utilization" not in colocate.vllm.model_fields_set  # derived, so a dump derives it again
    greedy = validate(
        minimal(here, vllm={"gpu_memory_utilization": 0.8}, trl={"use_vllm": True, "vllm_mode": "colocate"})
    )
    warnings = check_run_config(greedy, host())
    assert any("leaving it 20% for the model" in w for w in warnings), warnings


# ------------------------------------------------------------ TRL users


@pytest.mark.parametrize(
    ("data", "hint"),
    [
        (
            {"trl": {"per_device_train_batch_size": 8}},
            "TRL's name for grpo's 'micro_batch_size': write micro_batch_size",
        ),
        ({"dataset_name": "org/data"}, "grpo writes [[datasets]] with path"),
        ({"trl": {"vllm_gpu_memory_utilization": 0.3}}, "write gpu_memory_utilization = ... in [vllm]"),
        ({"trl": {"vllm_structured_outputs_regex": "a+"}}, "write vllm_guided_decoding_regex = ... in [trl]"),
        ({"model_name_or_path": "org/model"}, 'grpo writes base_model = "..."'),
    ],
)
def test_a_trl_name_gets_its_grpo_name(data: dict[str, Any], hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate({"base_model": "org/model", **data})
    assert hint in str(info.value)
    assert "did you mean" not in str(info.value) and "remove it" not in str(info.value)


def test_a_trl_shaped_config_is_told_what_differs(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rw, _ = names(here)
    (here / "c.toml").write_text(
        f'base_model = "org/model"\n[[datasets]]\npath = "org/data"\n[trl]\nreward_funcs = ["{rw}.accuracy_reward"]\n'
    )
    code, out, err = check(capsys)  # TRL's batch default is 8: grpo's 1 cannot hold a group of 8
    assert code == 2
    assert "micro_batch_size = 1 and gradient_accumulation_steps = 1: grpo's defaults" in err
    assert "TRL's per_device_train_batch_size defaults to 8" in err
    code, out, err = check(capsys, "--set", "micro_batch_size=8")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("vs TRL:"))
    for said in (
        "max_steps 100 (TRL: num_train_epochs = 3)",
        "lr_scheduler 'cosine' (TRL: lr_scheduler_type = 'linear')",
        "bf16 false (TRL: bf16 = true unless fp16)",
        "save_steps 50 (TRL: save_steps = 500)",
    ):
        assert said in line, line
    assert "micro_batch_size" not in line  # written, so not a default any more


def test_convert_reads_trls_cli_yaml_and_the_result_passes_check(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rw, _ = names(here)
    (here / "trl.yaml").write_text(
        f"""# trl grpo --config trl.yaml
model_name_or_path: org/model
dataset_name: org/data
dataset_config: main
reward_funcs: [{rw}.accuracy_reward, think_format_reward]
gradient_accumulation_steps: 2
num_generations: 8
use_vllm: true
vllm_gpu_memory_utilization: 0.4
vllm_structured_outputs_regex: "[0-9]+"
use_peft: true
lora_r: 32
lora_target_modules: all-linear
disable_dropout: true
max_steps: 300
""",
        encoding="utf-8",
    )
    assert cli.main(["config", "convert", "trl.yaml", "-o", "c.toml"]) == 0
    err = capsys.readouterr().err
    assert "does not validate" not in err, err
    text = (here / "c.toml").read_text(encoding="utf-8")
    data = tomllib.loads(text)
    assert data["base_model"] == "org/model" and data["datasets"] == [
        {"path": "org/data", "split": "train", "name": "main"}
    ]
    assert data["micro_batch_size"] == 8 and data["lr_scheduler"] == "linear" and data["bf16"] is True  # TRL's defaults
    assert data["max_steps"] == 300 and "num_epochs" not in data
    assert data["vllm"]["gpu_memory_utilization"] == 0.4 and data["trl"]["vllm_mode"] == "colocate"
    assert data["trl"]["vllm_guided_decoding_regex"] == "[0-9]+"
    assert data["trl"]["reward_funcs"] == [f"{rw}.accuracy_reward", "trl.rewards.format_rewards.think_format_reward"]
    assert (data["adapter"], data["lora_r"], data["lora_target_linear"], data["lora_dropout"]) == (
        "lora",
        32,
        True,
        0.05,
    )
    assert "# disable_dropout = true  # left out: not in grpo" in text
    code, out, err = check(capsys)
    assert code == 0, err
    assert out.rstrip().splitlines()[-1].startswith("c.toml: OK")


# ------------------------------------------------------------ smaller items


def test_tools_with_one_turn_warn_that_no_result_is_ever_read(here: Path) -> None:
    _, tl = names(here)
    cfg = validate(minimal(here, episodes={"max_turns": 1}, trl={"tools": [f"{tl}.calculate"]}))
    warnings = check_run_config(cfg, host())
    assert any("episodes.max_turns = 1 with tools" in w for w in warnings), warnings
    cfg = validate(minimal(here, episodes={"max_turns": 2}, trl={"tools": [f"{tl}.calculate"]}))
    assert not any("max_turns" in w for w in check_run_config(cfg, host()))


def test_bitsandbytes_kernel_notice_is_dropped_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    import grpo_core.modeling  # noqa: F401 - installs the filter, as any run's first model import does
    from grpo_core.modeling.quantization import KERNEL_NOTICE, KERNEL_NOTICE_LOGGER, cpu_kernel_note

    logger = logging.getLogger(KERNEL_NOTICE_LOGGER)
    with caplog.at_level(logging.WARNING, logger=KERNEL_NOTICE_LOGGER):
        logger.warning(
            KERNEL_NOTICE + ": %s. Please make sure you already `pip install kernels`", "No module 'kernels'"
        )
        logger.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]
    four_bit = validate({"base_model": "org/model", "adapter": "lora", "load_in_4bit": True})
    assert "pip install kernels" in (cpu_kernel_note(four_bit.load_in_4bit, cuda=False, flags={"avx512_bf16"}) or "")
    assert cpu_kernel_note(four_bit.load_in_4bit, cuda=True, flags={"avx512_bf16"}) is None
    assert (
        cpu_kernel_note(validate({"base_model": "org/model"}).load_in_4bit, cuda=False, flags={"avx512_bf16"}) is None
    )


def test_no_example_package_depends_on_a_grpo_from_the_index(tmp_path: Path) -> None:
    """grpo is installed from its clone, not from a package index: an example
    plugin package that listed `grpo` would send pip to the index for a
    project of that name wherever grpo is not installed yet. None lists it,
    and `pip install -e ./examples/grpo-plugin-example` resolves with
    --no-index (nothing could be fetched) to that package alone."""
    import json
    import shutil
    import subprocess

    from packaging.requirements import Requirement

    packages = sorted(p.parent for p in (REPO / "examples").glob("*/pyproject.toml"))
    assert {p.name for p in packages} >= {"grpo-plugin-example", "guess-number", "my-rewards"}
    for package in packages:
        project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
        needs = {Requirement(d).name for d in project.get("dependencies", [])}
        assert "grpo" not in needs, f"{package.name}: remove grpo from dependencies (pyproject.toml says why)"
    source = tmp_path / "example"
    shutil.copytree(REPO / "examples" / "grpo-plugin-example", source, ignore=shutil.ignore_patterns("*.egg-info"))
    report = tmp_path / "report.json"
    args = ["--dry-run", "--no-index", "--no-build-isolation", "--quiet", "--report", str(report), "-e", str(source)]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]] == ["grpo-plugin-example"]
    readme = (REPO / "examples" / "grpo-plugin-example" / "README.md").read_text()
    assert "pip install -e ./examples/grpo-plugin-example" in readme and "bash scripts/setup.sh" in readme
