"""grpo_core/optimization/batch.py on hand-built groups of uneven lengths.

Every token id below is unique, so each row of a micro-batch can be traced
back to the completion it came from and every value (advantage, mask,
sampler log-prob) checked against the token it must sit on. Pure tensors,
no model.
"""

from __future__ import annotations

import pytest
import torch

from grpo_core.contract.types import Completion, Prompt, RolloutGroup, ScoredGroup
from grpo_core.optimization.batch import Sample, collate, completion_tokens, flatten, micro_batches, with_signal_first

PAD = 0


def _completion(ids: list[int], truncated: bool = False, logps: bool = True) -> Completion:
    # sampler log-prob of token t is -t/1000: unique, and readable back from the value
    return Completion(token_ids=ids, text="", logprobs=[-t / 1000 for t in ids] if logps else None, truncated=truncated)


def groups() -> list[ScoredGroup]:
    a = RolloutGroup(
        Prompt("a", [11, 12, 13]),
        [_completion([101, 102]), _completion([103, 104, 105, 106], truncated=True), _completion([107])],
    )
    b = RolloutGroup(Prompt("b", [21]), [_completion([201, 202, 203]), _completion([])], policy_version=3)
    c = RolloutGroup(
        Prompt("c", [31, 32, 33, 34, 35]), [_completion([301]), _completion([302, 303, 304, 305, 306, 307])]
    )
    return [
        ScoredGroup(a, rewards=[[1.0], [0.0], [0.0]], advantages=[1.0, -0.5, -0.25]),
        ScoredGroup(b, rewards=[[0.0], [0.0]], advantages=[0.0, 0.0], replayed=True),
        ScoredGroup(c, rewards=[[1.0], [0.0]], advantages=[0.75, -0.75]),
    ]


# completion's first token (or the prompt's, for the empty one) -> (prompt, completion, advantage, truncated, replayed)
EXPECTED = {
    101: ([11, 12, 13], [101, 102], 1.0, False, False),
    103: ([11, 12, 13], [103, 104, 105, 106], -0.5, True, False),
    107: ([11, 12, 13], [107], -0.25, False, False),
    201: ([21], [201, 202, 203], 0.0, False, True),
    21: ([21], [], 0.0, False, True),
    301: ([31, 32, 33, 34, 35], [301], 0.75, False, False),
    302: ([31, 32, 33, 34, 35], [302, 303, 304, 305, 306, 307], -0.75, False, False),
}


def test_flatten_keeps_each_completion_with_its_prompt_and_advantage() -> None:
    samples = flatten(groups())
    got = [(s.prompt_ids, s.completion_ids, s.advantage, s.truncated, s.replayed) for s in samples]
    assert got == [EXPECTED[k] for k in (101, 103, 107, 201, 21, 301, 302)]
    assert samples[0].sampler_logps == [-0.101, -0.102] and samples[4].sampler_logps == []
    assert [s.length for s in samples] == [5, 7, 4, 4, 1, 6, 11]


def _check_rows(mb, mask_truncated: bool) -> list[int]:
    """Assert every row of ``mb`` is laid out right; return the rows' keys."""
    width_c = mb.completion_mask.shape[1]
    width_p = mb.input_ids.shape[1] - width_c
    keys = []
    for row in range(mb.input_ids.shape[0]):
        ids = mb.input_ids[row].tolist()
        completion_part = ids[width_p:]
        key = completion_part[0] if completion_part[0] != PAD else ids[width_p - 1]
        prompt, completion, advantage, truncated, replayed = EXPECTED[key]
        p, c = len(prompt), len(completion)
        # prompt left-padded against the prompt/completion boundary, completion right after it
        assert ids[:width_p] == [PAD] * (width_p - p) + prompt
        assert completion_part == completion + [PAD] * (width_c - c)
        assert mb.attention_mask[row].tolist() == [0] * (width_p - p) + [1] * (p + c) + [0] * (width_c - c)
        masked_out = mask_truncated and truncated
        assert mb.completion_mask[row].tolist() == [0.0 if masked_out else 1.0] * c + [0.0] * (width_c - c)
        assert mb.advantages[row].item() == advantage
        assert bool(mb.replayed[row]) == replayed
        assert mb.sampler_logps is not None
        torch.testing.assert_close(mb.sampler_logps[row, :c], torch.tensor([-t / 1000 for t in completion]))
        assert mb.sampler_logps[row, c:].abs().sum() == 0
        keys.append(key)
    return keys


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_micro_batches_put_every_value_on_its_own_tokens(size: int, mask_truncated: bool) -> None:
    batches = micro_batches(flatten(groups()), size, PAD, mask_truncated)
    assert [mb.input_ids.shape[0] for mb in batches] == [min(size, 7 - i) for i in range(0, 7, size)]
    keys = [key for mb in batches for key in _check_rows(mb, mask_truncated)]
    assert sorted(keys) == sorted(EXPECTED)  # every completion exactly once
    # sorted by total length: each micro-batch pads only to lengths like its own
    lengths = [len(EXPECTED[k][0]) + len(EXPECTED[k][1]) for k in keys]
    assert lengths == sorted(lengths)
    # masked tokens: all real completion tokens, less the truncated one's when masked
    assert sum(float(mb.completion_mask.sum()) for mb in batches) == 17 - (4 if mask_truncated else 0)


def test_truncated_row_masked_only_when_asked() -> None:
    truncated = [s for s in flatten(groups()) if s.truncated]
    assert collate(truncated, PAD, mask_truncated=True).completion_mask.sum() == 0
    assert collate(truncated, PAD, mask_truncated=False).completion_mask.sum() == 4


def test_no_sampler_logps_when_any_row_lacks_them() -> None:
    rows = [Sample([1], [2, 3], 1.0, sampler_logps=[-0.1, -0.2]), Sample([1], [4], -1.0, sampler_logps=None)]
    assert collate(rows, PAD, mask_truncated=False).sampler_logps is None
    assert collate(rows[:1], PAD, mask_truncated=False).sampler_logps is not None


def test_has_signal_is_false_only_for_all_zero_advantages() -> None:
    zero = [Sample([1], [2], 0.0), Sample([1], [3, 4], 0.0)]
    assert not collate(zero, PAD, False).has_signal
    assert collate([*zero, Sample([1], [5], 1e-3)], PAD, False).has_signal
    assert collate([Sample([1], [5], -0.5)], PAD, False).has_signal


def test_completion_tokens_count_what_the_mask_counts() -> None:
    samples = flatten(groups())
    for mask_truncated in (False, True):
        mb = collate(samples, PAD, mask_truncated)
        assert completion_tokens(samples, mask_truncated) == int(mb.completion_mask.sum())


def test_with_signal_first_keeps_signal_and_tops_up_in_order() -> None:
    samples = flatten(groups())  # 7 samples; the 2 of group b have advantage 0
    signal = [s for s in samples if s.has_signal]
    assert len(signal) == 5 and with_signal_first(samples, 0) == signal
    topped = with_signal_first(samples, 6)
    assert len(topped) == 6 and [s for s in topped if not s.has_signal] == [samples[3]]
    assert topped == [s for s in samples if s in topped]  # original order
    assert with_signal_first(samples, 99) == samples


class _TwoRanks:
    """The other rank's per-step counts, as ``Distributed.gather`` would
    return them (no process group here: the gather is what is faked)."""

    def __init__(self, other: list[int]) -> None:
        self.other = other

    def gather(self, mine: list[int]) -> list[list[int]]:
        return [mine, self.other]


def _rows_to_train(other_rank_needs: list[int], parts: list[list[Sample]], micro_batch_size: int) -> list[list[Sample]]:
    from types import SimpleNamespace

    from grpo_core.training.trainer import GRPOTrainer

    trainer = SimpleNamespace(
        drops_zero_advantage_rows=True,
        cfg=SimpleNamespace(micro_batch_size=micro_batch_size),
        dist=_TwoRanks(other_rank_needs),
    )
    return GRPOTrainer._rows_to_train(trainer, parts)


def test_rows_to_train_run_as_many_micro_batches_as_the_busiest_rank() -> None:
    samples = flatten(groups())  # 5 with signal, 2 without
    # alone (the other rank needs no more): only the 5 rows with signal, in 3 micro-batches of 2
    alone = _rows_to_train([0], [samples], micro_batch_size=2)[0]
    assert alone == [s for s in samples if s.has_signal]
    # the other rank needs 4 micro-batches: this one keeps a zero row to run 4 too (2+2+2+1)
    busy = _rows_to_train([4], [samples], micro_batch_size=2)[0]
    assert len(busy) == 7 and len(micro_batches(busy, 2, PAD, False)) == 4
    busy = _rows_to_train([2], [samples], micro_batch_size=3)[0]  # 5 rows already make 2 micro-batches of 3
    assert busy == alone
    # nothing with signal here, 1 micro-batch there: one inert row, one micro-batch
    inert = [s for s in samples if not s.has_signal]
    assert [len(p) for p in _rows_to_train([1], [inert], micro_batch_size=2)] == [1]
    assert _rows_to_train([0], [inert], micro_batch_size=2) == [[]]
