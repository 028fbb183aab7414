"""``generation_batch_size`` / ``steps_per_generation`` mean what they mean
in TRL: one generation batch feeds ``generation_batch_size /
(micro_batch_size x gradient_accumulation_steps)`` optimizer steps, and
``gradient_accumulation_steps`` is never overridden.

The parity test runs TRL 1.16's own ``GRPOTrainer._prepare_inputs`` (the
method that buffers a generation and hands out its slices) on a stand-in
``self`` whose generation just numbers completions, and grpo's real training
loop on a tiny model (tests/tiny_model.py); both must give every optimizer
step the same shape: which generation it trains on, and how many
micro-batches of how many completions.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import raw_config, run_workdir

from grpo_core.config.loader import validate
from grpo_core.contract.errors import ConfigError
from grpo_core.optimization.batch import generation_batch_size, steps_per_batch, steps_per_generation
from grpo_core.training.run import run_training
from grpo_core.validation.run_check import check_run_config

REWARDS = "def parity(completion_ids, **kwargs):\n    return [float(sum(ids) % 2) for ids in completion_ids]\n"


RUN = {
    "adapter": None,
    "sequence_len": 64,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "max_steps": 4,
    "learning_rate": 1e-3,
    "lr_scheduler": "constant",
    "seed": 3,
}


def cfg_for(tmp: Path, model: str = "unused/model", **settings):
    trl = {
        k: settings.pop(k) for k in ("generation_batch_size", "steps_per_generation", "num_iterations") if k in settings
    }
    trl = {
        "num_generations": 4,
        "max_completion_length": 3,
        "reward_funcs": ["gb_rewards.parity"],
        "temperature": 1.0,
        "skip_zero_advantage_batches": False,
        **trl,
    }
    return validate(raw_config(model, tmp, **(RUN | settings), trl=trl))


# ----------------------------------------------------------------------------- config


def config_workdir(tmp: Path, monkeypatch) -> None:
    """The dataset and reward module the config names exist: the config check reads both."""
    run_workdir(tmp, [{"prompt": "Count:"}], {"gb_rewards": REWARDS}, monkeypatch)


@pytest.mark.parametrize(
    ("settings", "per_generation"),
    [({}, 1), ({"generation_batch_size": 8}, 1), ({"generation_batch_size": 16}, 2), ({"steps_per_generation": 6}, 3)],
)
def test_generation_batch_feeds_whole_optimizer_steps(
    tmp_path: Path, settings: dict, per_generation: int, monkeypatch
) -> None:
    config_workdir(tmp_path, monkeypatch)
    cfg = cfg_for(tmp_path, **settings)
    check_run_config(cfg)
    assert steps_per_generation(cfg) == per_generation
    assert generation_batch_size(cfg) == 8 * per_generation
    assert cfg.gradient_accumulation_steps == 2  # never overridden
    assert steps_per_batch(cfg_for(tmp_path, num_iterations=2, **settings)) == 2 * per_generation


@pytest.mark.parametrize(
    ("settings", "fragments"),
    [
        (
            {"generation_batch_size": 12},
            [
                "trl.generation_batch_size = 12",
                "not a multiple of micro_batch_size x gradient_accumulation_steps = 8",
                "trl.generation_batch_size = 8",
            ],
        ),
        ({"generation_batch_size": 4}, ["trl.generation_batch_size = 4", "smaller than a step", "= 8"]),
        ({"steps_per_generation": 3}, ["trl.steps_per_generation (3)", "trl.steps_per_generation = 2"]),
        ({"generation_batch_size": 16, "steps_per_generation": 4}, ["both set", "set only one"]),
    ],
)
def test_unsupported_generation_batches_are_refused_by_name(
    tmp_path: Path, settings: dict, fragments: list[str], monkeypatch
) -> None:
    config_workdir(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as info:
        check_run_config(cfg_for(tmp_path, **settings))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ----------------------------------------------------------------------------- parity with TRL


def trl_schedule(
    micro: int, ga: int, gbs: int, num_iterations: int, steps: int, tmp: Path
) -> list[tuple[int, list[int], frozenset]]:
    """Per optimizer step: (generation number, micro-batch sizes, rows),
    from TRL's own ``_prepare_inputs`` driven as its Trainer drives it."""
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    args = TRLConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=ga,
        generation_batch_size=gbs,
        num_generations=4,
        num_iterations=num_iterations,
        use_cpu=True,
        bf16=False,
        report_to=[],
    )
    state = SimpleNamespace(
        model=SimpleNamespace(training=True),
        args=args,
        num_iterations=num_iterations,
        _step=0,
        _buffered_inputs=None,
        generations=0,
    )

    def generate(_batch):  # a generation: numbered completions (TRL then shuffles and slices them)
        state.generations += 1
        size = args.per_device_train_batch_size * args.steps_per_generation
        return {"generation": torch.full((size,), state.generations), "row": torch.arange(size)}

    state._generate_and_score_completions = generate
    schedule = []
    for _ in range(steps):
        sizes, rows, generations = [], set(), set()
        for _ in range(args.gradient_accumulation_steps):  # Trainer: one _prepare_inputs per micro-step
            inputs = TRLTrainer._prepare_inputs(state, None)
            state._step += 1  # what GRPOTrainer.training_step does
            sizes.append(len(inputs["row"]))
            rows |= {int(r) for r in inputs["row"]}
            generations |= {int(g) for g in inputs["generation"]}
        assert len(generations) == 1
        schedule.append((generations.pop(), sizes, frozenset(rows)))
    return schedule


def grpo_schedule(cfg, monkeypatch) -> list[tuple[int, list[int], frozenset]]:
    """The same, from grpo's real loop: rows are identified by their tokens."""
    import grpo_core.training.trainer as trainer_module

    seen: list[tuple[int, int, list[tuple[int, ...]]]] = []
    produced = []
    real_forward, real_set = trainer_module.GRPOTrainer._forward, trainer_module.GRPOTrainer._set_batch

    def set_batch(self, batch):
        produced.append(self.step)
        return real_set(self, batch)

    def forward(self, model, mb, with_entropy):
        if with_entropy:  # the training forward (old/ref log-probs are taken without entropy)
            seen.append((self.step, len(produced), [tuple(r) for r in mb.input_ids.tolist()]))
        return real_forward(self, model, mb, with_entropy)

    monkeypatch.setattr(trainer_module.GRPOTrainer, "_forward", forward)
    monkeypatch.setattr(trainer_module.GRPOTrainer, "_set_batch", set_batch)
    assert run_training(cfg) == "completed"
    schedule = []
    for step in range(cfg.max_steps):
        calls = [c for c in seen if c[0] == step]
        assert len({c[1] for c in calls}) == 1
        rows = [r for c in calls for r in c[2]]
        assert len(rows) == len(set(rows))
        schedule.append((calls[0][1], [len(c[2]) for c in calls], frozenset(rows)))
    return schedule


def _shape(schedule):
    return [(generation, sorted(sizes)) for generation, sizes, _ in schedule]


def _partition_checks(schedule, per_generation: int, num_iterations: int, batch: int) -> None:
    """Within one generation: each iteration's steps use every completion
    exactly once, and each iteration repeats the same slices in order."""
    cycle = per_generation * num_iterations
    for start in range(0, len(schedule) - cycle + 1, cycle):
        block = schedule[start : start + cycle]
        first = [rows for _, _, rows in block[:per_generation]]
        assert sum(len(r) for r in first) == batch and len(frozenset().union(*first)) == batch
        for i in range(1, num_iterations):
            assert [rows for _, _, rows in block[i * per_generation : (i + 1) * per_generation]] == first


@pytest.mark.parametrize(("gbs", "num_iterations", "steps"), [(8, 1, 2), (16, 1, 4), (16, 2, 4), (24, 1, 3)])
def test_each_step_sees_trls_batch_shapes(
    tiny_model_dir: str, tmp_path: Path, monkeypatch, gbs: int, num_iterations: int, steps: int
) -> None:
    run_workdir(tmp_path, [{"prompt": f"Count to {i}:"} for i in range(12)], {"gb_rewards": REWARDS}, monkeypatch)
    model = tiny_model_dir
    cfg = cfg_for(tmp_path, model, generation_batch_size=gbs, num_iterations=num_iterations, max_steps=steps)

    theirs = trl_schedule(4, 2, gbs, num_iterations, steps, tmp_path)
    ours = grpo_schedule(cfg, monkeypatch)
    assert _shape(ours) == _shape(theirs), (ours, theirs)
    per_generation = gbs // 8
    _partition_checks(theirs, per_generation, num_iterations, gbs)
    _partition_checks(ours, per_generation, num_iterations, gbs)
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    generated = [("reward" in r) for r in metrics]  # batch metrics only on a step that generated
    assert generated == [i % (per_generation * num_iterations) == 0 for i in range(steps)]
