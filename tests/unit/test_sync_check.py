"""The weight-sync check's judgement (grpo_core/sync/verify.py) on
made-up numbers: which precision class a trainer/engine pair is in, the first
check's ceiling, the bound later checks are held to, one retry then a stop,
and the ``sync/*`` metrics. The real engines and runs are in
tests/e2e/vllm/test_sync_verification.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from plugin_set import write_distribution

from grpo_core.contract.errors import EngineUnavailable, GrpoError, WeightSyncUnverified
from grpo_core.contract.types import SCORES_TOKENS, EngineScore
from grpo_core.modeling.precision import Precision
from grpo_core.sync.verify import (
    FLOAT32,
    HALF,
    Floors,
    SyncVerifier,
    compare,
    noise_class,
    sampled_tokens_can_check,
    trainer_dtype_name,
)

FP32 = Precision(torch.float32, None, "float32")
BF16_LORA = Precision(torch.bfloat16, torch.bfloat16, "bf16")
BF16_FULL = Precision(torch.float32, torch.bfloat16, "bf16")


def test_precision_classes_come_from_the_dtypes() -> None:
    assert trainer_dtype_name(FP32) == "float32"
    assert trainer_dtype_name(BF16_LORA) == "bfloat16" and trainer_dtype_name(BF16_FULL) == "bfloat16"
    assert noise_class("float32", "float32") is FLOAT32
    assert noise_class("float32", "bfloat16") is HALF and noise_class("bfloat16", "float32") is HALF
    assert noise_class("float16", None, floor=1e-6) is HALF  # a 16-bit trainer is 16-bit whatever it measures
    # an engine of unknown dtype: the first check's floor tells (float32 noise is 1000x smaller)
    assert noise_class("float32", None) is HALF
    assert noise_class("float32", None, floor=5e-6) is FLOAT32
    assert noise_class("float32", None, floor=0.03) is HALF


def test_bounds_sit_between_the_measured_noise_and_a_one_step_change() -> None:
    # measured here: float32 5.2e-6 mean (one LoRA step at lr 1e-3 moves the probe by ~1e-2 or more)
    assert 5.2e-6 < FLOAT32.bound(5.2e-6) < 1e-3
    assert FLOAT32.bound(5.2e-6) == pytest.approx(4 * 5.2e-6 + 5e-5)
    # measured here: bf16 0.031-0.055 mean; the bound leaves room for the floor to vary by 2x
    assert 0.08 < HALF.bound(0.035) < 0.12
    assert HALF.bound(1.0) == HALF.ceiling  # never looser than the ceiling


def test_compare_is_mean_and_max_abs_difference() -> None:
    mean, worst = compare([-1.0, -2.0, -3.0, -4.0], EngineScore("s", [-1.0, -2.5, -3.0, -3.9]))
    assert mean == pytest.approx(0.15) and worst == pytest.approx(0.5)
    with pytest.raises(ValueError, match="scored 3 tokens"):
        compare([-1.0, -2.0], EngineScore("s", [-1.0, -2.0, -3.0]))


def test_first_check_measures_the_floor_and_later_ones_are_held_to_it() -> None:
    floors = Floors("float32", "float32")
    first = floors.judge("A", 6e-6, 2e-5)
    assert first.ok and first.first and first.bound == FLOAT32.ceiling
    floors.accept([first])
    assert floors.floors == {"A": 6e-6}
    later = floors.judge("A", 3e-5, 1e-4)
    assert later.ok and not later.first and later.bound == pytest.approx(4 * 6e-6 + 5e-5)
    stale = floors.judge("A", 0.02, 0.3)  # one training step the engine never got
    assert not stale.ok and "noise floor 6e-06" in stale.describe()
    floors.accept([stale])
    assert floors.floors == {"A": 6e-6}  # a failed check never moves the floor
    # a server seen for the first time (a pool member) gets its own first check
    assert floors.judge("B", 6e-6, 2e-5).first


def test_an_engine_serving_other_weights_fails_the_first_check() -> None:
    assert not Floors("float32", "float32").judge("A", 0.5, 3.0).ok
    assert not Floors("bfloat16", "bfloat16").judge("A", 0.5, 3.0).ok
    assert Floors("bfloat16", "bfloat16").judge("A", 0.04, 0.2).ok  # bf16 noise is no failure


class FakeEngine:
    """An engine whose servers answer made-up log-probs: ``offsets`` is added
    to the trainer's values per server (what a stale server shows)."""

    capabilities = frozenset({SCORES_TOKENS})
    weight_dtype = "float32"
    description = "fake engine"

    def __init__(self, servers: list[str], trainer: list[float]) -> None:
        self.offsets = dict.fromkeys(servers, 1e-6)
        self.trainer = trainer
        self.calls = 0
        self.error: Exception | None = None

    def score_tokens(self, ids: list[int]) -> list[EngineScore]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return [EngineScore(name, [t + off for t in self.trainer], "base") for name, off in self.offsets.items()]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """A verifier over a FakeEngine with two servers; the trainer's side is
    fixed log-probs (its forward is tested against vLLM in the real runs)."""
    trainer = [-1.0, -2.0, -0.5, -3.0]
    monkeypatch.setattr("grpo_core.sync.verify.trainer_logprobs", lambda model, ids, precision: list(trainer))
    engine = FakeEngine(["server A", "server B"], trainer)
    logs: list[str] = []
    verifier = SyncVerifier("every", engine, [1, 2, 3, 4, 5], FP32, logs.append)
    return verifier, engine, logs


def test_a_stale_server_is_retried_once_then_named(fake) -> None:
    verifier, engine, logs = fake
    syncs: list[int] = []
    verifier.sync(lambda: syncs.append(0), model=None, version=0)
    assert syncs == [0] and verifier.floors.floors == {"server A": pytest.approx(1e-6), "server B": pytest.approx(1e-6)}
    assert "weight sync verified" in logs[-1]
    metrics = verifier.take_metrics()
    assert (
        metrics["sync/verified"] == 1.0
        and metrics["sync/logprob_gap"] == pytest.approx(1e-6)
        and metrics["sync/retries"] == 0.0
    )
    assert verifier.take_metrics()["sync/verified"] == 0.0  # nothing checked since: "not checked"

    engine.offsets["server B"] = 0.05  # B never got version 1
    with pytest.raises(WeightSyncUnverified) as info:
        verifier.sync(lambda: syncs.append(1), model=None, version=1)
    assert syncs == [0, 1, 1]  # synced, checked, synced once more, checked, stopped
    message = str(info.value)
    assert "policy version 1" in message and "server B" in message and "server A" not in message
    assert "0.05" in message and "\n" not in message
    assert any("not verified" in line and "syncing again" in line for line in logs)
    metrics = verifier.take_metrics()
    assert (
        metrics["sync/verified"] == 0.0
        and metrics["sync/logprob_gap"] == pytest.approx(0.05)
        and metrics["sync/retries"] == 1.0
    )


def test_a_sync_the_retry_fixes_goes_on(fake) -> None:
    verifier, engine, logs = fake
    verifier.sync(lambda: None, model=None, version=0)
    attempts: list[int] = []

    def flaky_sync() -> None:
        attempts.append(1)
        engine.offsets["server A"] = 0.3 if len(attempts) == 1 else 2e-6  # the second sync reaches it

    verifier.sync(flaky_sync, model=None, version=1)
    assert len(attempts) == 2
    metrics = verifier.take_metrics()
    assert metrics["sync/verified"] == 1.0 and metrics["sync/retries"] == 1.0 and metrics["sync/logprob_gap"] < 1e-5
    assert metrics["sync/verify_seconds"] >= 0.0


def test_modes_first_and_never(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    verifier, engine, _ = fake
    verifier.mode = "first"
    verifier.sync(lambda: None, model=None, version=0)
    engine.offsets["server A"] = 1.0
    verifier.sync(lambda: None, model=None, version=1)  # not checked: no error
    assert engine.calls == 1
    verifier.mode = "never"
    verifier.checks = 0
    verifier.sync(lambda: None, model=None, version=2)
    assert engine.calls == 1


@pytest.fixture
def one_server(monkeypatch: pytest.MonkeyPatch):
    """A verifier over one fake server that may check syncs on the sampled
    tokens (``sampled=True``, as the trainer builds it for a plain run)."""
    trainer = [-1.0, -2.0, -0.5, -3.0]
    monkeypatch.setattr("grpo_core.sync.verify.trainer_logprobs", lambda model, ids, precision: list(trainer))
    engine = FakeEngine(["server"], trainer)
    logs: list[str] = []
    return SyncVerifier("every", engine, [1, 2, 3, 4, 5], FP32, logs.append, sampled=True), engine, logs


def samples(gap: float, rows: int = 2, tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer, engine, mask) log-probs of sampled tokens ``gap`` apart; the
    last token of each row is padding (masked, and far off: never counted)."""
    trainer = -torch.rand(rows, tokens) * 0.01  # small: float32 keeps a 1e-6 gap to 0.1%
    engine = trainer + gap
    mask = torch.ones(rows, tokens)
    mask[:, -1] = 0
    engine[:, -1] = 50.0
    return trainer, engine, mask


def train_step(verifier: SyncVerifier, version: int, gap: float | None) -> None:
    """What the trainer does in one step: the loss's micro-batches show their
    sampled tokens of ``version`` (none when ``gap`` is None), then the check
    settles before the optimizer step."""
    if gap is not None:
        for _ in range(2):
            verifier.observe(version, *samples(gap))
    verifier.settle()


def test_after_calibration_syncs_are_checked_on_the_sampled_tokens_without_the_engine(one_server) -> None:
    verifier, engine, logs = one_server
    verifier.sync(lambda: None, model=None, version=0)  # the first sync: probed
    assert engine.calls == 1 and not verifier.waiting
    train_step(verifier, 0, gap=2e-6)  # its samples set the sampled floor (the probe verified version 0)
    assert verifier.floors.floors["fake engine (sampled tokens)"] == pytest.approx(2e-6, rel=1e-2)
    assert "checked on the sampled tokens" in logs[-1] and "20 tokens of policy version 0" in logs[-1]
    verifier.take_metrics()
    for version in (1, 2, 3):
        verifier.sync(lambda: None, model=None, version=version)
        assert verifier.waiting  # checked by the next step, not now
        train_step(verifier, version, gap=3e-6)
        metrics = verifier.take_metrics()
        assert metrics["sync/verified"] == 1.0 and metrics["sync/sampled"] == 1.0
        assert metrics["sync/logprob_gap"] == pytest.approx(3e-6, rel=1e-2)
        assert metrics["sync/logprob_bound"] == pytest.approx(4 * 2e-6 + 5e-5, rel=1e-3)
    assert engine.calls == 1  # no probe after the first sync


def test_samples_of_an_older_version_fail_the_check_and_the_probe_decides(one_server) -> None:
    verifier, engine, logs = one_server
    verifier.sync(lambda: None, model=None, version=0)
    train_step(verifier, 0, gap=2e-6)
    syncs: list[int] = []
    verifier.sync(lambda: syncs.append(1), model=None, version=1)
    train_step(
        verifier, 1, gap=0.02
    )  # the engine sampled from other weights than version 1's; the second sync fixes it
    assert syncs == [1, 1] and engine.calls == 2
    assert any("do not match the trainer's log-probs" in line and "syncing again" in line for line in logs)
    metrics = verifier.take_metrics()
    assert metrics["sync/verified"] == 1.0 and metrics["sync/retries"] == 1.0 and metrics["sync/sampled"] == 0.0

    verifier.sync(lambda: syncs.append(2), model=None, version=2)  # still checked on the samples after a retry
    engine.offsets["server"] = 0.05  # and this time the engine never gets it
    with pytest.raises(WeightSyncUnverified, match="policy version 2 did not reach the engine"):
        train_step(verifier, 2, gap=0.05)
    assert syncs == [1, 1, 2, 2]


def test_without_sampled_tokens_of_the_synced_version_the_probe_runs_before_the_optimizer_step(one_server) -> None:
    verifier, engine, _ = one_server
    verifier.sync(lambda: None, model=None, version=0)
    train_step(verifier, 0, gap=2e-6)
    verifier.sync(lambda: None, model=None, version=1)
    train_step(verifier, 0, gap=2e-6)  # a step on the previous version's batch (several steps per generation)
    assert engine.calls == 2 and not verifier.waiting
    assert verifier.take_metrics()["sync/sampled"] == 0.0
    verifier.sync(lambda: None, model=None, version=2)
    train_step(verifier, 2, gap=None)  # every micro-batch skipped, or a loss that never asked for IS weights
    assert engine.calls == 3
    verifier.sync(lambda: None, model=None, version=3)
    verifier.flush()  # an evaluation, or the end of training
    assert engine.calls == 4 and not verifier.waiting


def test_sampled_log_probs_that_are_not_the_trainers_keep_the_probe(one_server) -> None:
    verifier, engine, logs = one_server
    verifier.sync(lambda: None, model=None, version=0)
    train_step(verifier, 0, gap=0.4)  # e.g. an engine returning log-probs before temperature
    assert not verifier.sampled and "every sync stays checked with the probe" in logs[-1]
    verifier.sync(lambda: None, model=None, version=1)
    assert engine.calls == 2 and not verifier.waiting


def test_a_pool_and_the_probe_modes_are_never_checked_on_samples(fake, one_server) -> None:
    pool, engine, _ = fake  # two servers: a sample cannot name the server that drew it
    pool.sampled = True
    pool.sync(lambda: None, model=None, version=0)
    assert not pool.sampled
    train_step(pool, 0, gap=2e-6)
    pool.sync(lambda: None, model=None, version=1)
    assert engine.calls == 2 and not pool.waiting
    verifier, engine, _ = one_server
    for mode in ("every_probe", "first"):
        probe_only = SyncVerifier(mode, engine, [1, 2, 3], FP32, sampled=True)
        assert not probe_only.sampled


def test_which_runs_can_check_syncs_on_their_samples() -> None:
    from grpo_core.config.loader import validate

    base = {
        "base_model": "org/m",
        "datasets": [{"path": "org/d"}],
        "micro_batch_size": 4,
        "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"]},
    }
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
    assert sampled_tokens_can_check(validate(base), plain, single_process=True) is None
    assert sampled_tokens_can_check(validate(base), plain, single_process=False) == "several processes"
    for key, value in [
        ("top_p", 0.9),
        ("top_k", 20),
        ("min_p", 0.1),
        ("repetition_penalty", 1.1),
        ("async_prefetch", True),
    ]:
        cfg = validate({**base, "trl": {**base["trl"], key: value}})
        assert key in sampled_tokens_can_check(cfg, plain, single_process=True)
    dropout = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    assert "dropout" in sampled_tokens_can_check(validate(base), dropout, single_process=True)


def test_a_models_configured_attention_dropout_counts(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from grpo_core.sync.verify import dropout_active

    path = tiny_model_dir
    assert not dropout_active(AutoModelForCausalLM.from_pretrained(path))
    assert dropout_active(AutoModelForCausalLM.from_pretrained(path, attention_dropout=0.1))


def test_an_engine_that_cannot_serve_the_probe_is_a_failed_check_but_an_unreachable_one_is_not(fake) -> None:
    verifier, engine, _ = fake
    engine.error = GrpoError("vLLM server at X: The model `policy` does not exist.")
    with pytest.raises(WeightSyncUnverified, match="does not exist"):
        verifier.sync(lambda: None, model=None, version=0)
    assert math.isinf(verifier.take_metrics().get("sync/logprob_gap", math.inf))
    engine.error = EngineUnavailable("vLLM server at X did not answer")
    with pytest.raises(EngineUnavailable):  # the loop's own handling: checkpoint, engine-unavailable exit
        verifier.sync(lambda: None, model=None, version=0)


def test_without_the_capability_nothing_is_checked_and_one_line_says_so() -> None:
    logs: list[str] = []
    engine = FakeEngine(["s"], [-1.0])
    engine.capabilities = frozenset()
    verifier = SyncVerifier.build("every", engine, tokenizer=None, precision=FP32, log=logs.append)
    verifier.sync(lambda: None, model=None, version=0)
    assert engine.calls == 0 and not verifier.active
    assert len(logs) == 1 and "cannot score tokens" in logs[0]
    assert verifier.take_metrics()["sync/verified"] == 0.0
    logs.clear()
    SyncVerifier.build("every", None, tokenizer=None, precision=FP32, log=logs.append)
    assert len(logs) == 1 and "nothing to verify" in logs[0]
    logs.clear()
    SyncVerifier.build("never", None, tokenizer=None, precision=FP32, log=logs.append)
    assert logs == []


ROLLOUT_MODULE = '''
from grpo_core.plugin_api import hookimpl
from grpo_core.contract.types import WEIGHTS_FROM_PATH


class PathOnlyRollout:
    """A rollout whose engine loads weights from files but cannot score tokens."""

    engine_capabilities = frozenset({WEIGHTS_FROM_PATH})

    def __init__(self, context):
        self.context = context

    @hookimpl
    def grpo_rollout_generate(self, prompts, num_generations, sampling, policy_version):
        raise NotImplementedError
'''


@pytest.fixture
def path_only_rollout(tmp_path, monkeypatch: pytest.MonkeyPatch):
    from grpo_core.host import plugin_host

    site = write_distribution(
        tmp_path / "site",
        "grpo_path_only",
        ROLLOUT_MODULE,
        "grpo-path-only",
        "[grpo.rollout]\npath_only = grpo_path_only:PathOnlyRollout\n",
    )
    monkeypatch.syspath_prepend(str(site))
    plugin_host.rescan()
    yield
    plugin_host.rescan()


@pytest.mark.parametrize("setting", [None, "never", "first"])
def test_config_check_refuses_an_explicit_check_the_rollouts_engine_cannot_run(
    path_only_rollout, setting: str | None
) -> None:
    from grpo_core.config.loader import validate
    from grpo_core.validation.run_check import check_run_config

    data = {
        "base_model": "org/m",
        "datasets": [{"path": "org/d"}],
        "micro_batch_size": 4,
        "trl": {"num_generations": 4, "reward_funcs": ["last_number_match"]},
        "plugins": {"rollout": "path_only", "weight_sync": "full_filesystem"},
    }
    if setting is not None:
        data["verify_weight_sync"] = setting
    cfg = validate(data)
    if setting != "first":  # unset: the default, not a request; 'never' asks for nothing
        check_run_config(cfg)
        return
    with pytest.raises(GrpoError, match=r"verify_weight_sync = 'first' .* rollout 'path_only' .* no 'scores_tokens'"):
        check_run_config(cfg)


def test_the_trainers_side_is_the_eval_mode_forward_and_leaves_the_mode_alone(
    smollm2_dir: str, tiny_model_dir: str
) -> None:
    """The probe's log-probs are the model's own (no dropout: eval mode), of
    the tokenizer's ids of the fixed text, and training mode is restored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.sync.verify import PROBE_TOKENS, probe_ids, trainer_logprobs

    path = tiny_model_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attention_dropout=0.9)
    ids = probe_ids(AutoTokenizer.from_pretrained(smollm2_dir))
    assert len(ids) == PROBE_TOKENS
    model.train()
    first = trainer_logprobs(model, ids, FP32)
    assert model.training
    assert trainer_logprobs(model, ids, FP32) == first  # no dropout mask drawn: the same numbers every time
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert first == pytest.approx(expected.tolist(), abs=1e-5)
