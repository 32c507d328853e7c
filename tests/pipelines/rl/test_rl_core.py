"""RL core: reward terms, the judge client, the rollout strategy, GRPO and PPO math vs verl."""

from __future__ import annotations

import pytest
import torch

from pipelines.config.reward import JudgeConfig, RewardConfig
from pipelines.config.rl import AlgorithmConfig, StrategyConfig
from pipelines.core.records import Task
from pipelines.rl.algos import kl_loss, policy_loss
from pipelines.rl.strategy import Group, Rollout, Selector, broken_reason, select_groups
from pipelines.scoring.judge import Judge, family_of, judge_prompt
from pipelines.scoring.reward import compute_reward
from pipelines.store import Store
from tests.helpers import FakeOpenAI, chat_completion, scripted_openai

COUNT = Task(id="c", data_source="synth/image-search", question="How many red objects?",
             answer="3", answer_type="number")
CHOICE = Task(id="m", data_source="vstar", question="Colour?\n(A) red\n(B) blue", answer="B",
              answer_type="choice", options=["red", "blue"])
MRA = Task(id="d", data_source="synth/video", question="How far?", answer="100",
           answer_type="number", metadata={"metric": "mra"})


def reward(task, answer, calls=2, chars=None, well_formed=True, **cfg):
    return compute_reward(task, answer, answer_chars=len(answer or "") if chars is None else chars,
                          successful_tool_calls=calls, well_formed=well_formed,
                          cfg=RewardConfig(**cfg))


# -- rewards ------------------------------------------------------------------------------------


def test_correct_answer_gets_accuracy_and_tool_bonus():
    r = reward(COUNT, "3", calls=2)
    assert (r.accuracy, r.tool, r.correct) == (1.0, pytest.approx(0.2), True)
    assert r.total == pytest.approx(1.2) and r.scorer.startswith("synth-image")


def test_tool_bonus_only_when_correct():
    r = reward(COUNT, "4", calls=5)
    assert (r.total, r.accuracy, r.tool, r.correct) == (0.0, 0.0, 0.0, False)


def test_tool_bonus_cap():
    assert reward(COUNT, "3", calls=10, tool_reward_cap=0.3).tool == pytest.approx(0.3)


def test_length_guard_zeroes_the_whole_reward():
    r = reward(COUNT, "3", calls=3, chars=5000, max_answer_chars=1000)
    assert r.total == 0.0 and r.tool == 0.0 and r.scorer == "length-guard"


def test_malformed_gets_format_penalty():
    r = reward(COUNT, None, well_formed=False, format_penalty=0.5)
    assert r.total == -0.5 and r.format == -0.5 and not r.correct


def test_choice_by_letter_and_mra_modes():
    assert reward(CHOICE, "B").correct and not reward(CHOICE, "A").correct
    binary = reward(MRA, "92", calls=0)
    assert binary.correct and binary.accuracy == 1.0
    graded = reward(MRA, "92", calls=0, accuracy_mode="mra")
    assert 0.5 < graded.accuracy < 1.0
    assert reward(MRA, "no number here", calls=1).total == 0.0  # never crashes


# -- judge --------------------------------------------------------------------------------------


def judge_server(replies: list[tuple[int, str]]) -> FakeOpenAI:
    """A judge endpoint answering ``(status, text)`` replies in order."""
    return scripted_openai([(status, chat_completion(text)) for status, text in replies])


def _judge(url, store=None, retries=2):
    # A generous timeout: these servers answer at once, and a stalled reply on a busy machine
    # would be retried and take the next scripted one.
    return Judge(JudgeConfig(base_url=url, max_retries=retries, backoff_s=0.0, timeout_s=30), store)


def test_judge_answers_and_caches(tmp_path):
    server = judge_server([(200, "Judgement: 1"), (200, "Judgement: 0")])
    store = Store(tmp_path / "s.duckdb")
    try:
        judge = _judge(server.url, store)
        assert judge.judge("Q?", "dark red", "red", "vstar") == 1.0
        assert judge.judge("Q?", "blue", "red", "vstar") == 0.0
        # Same question again: from the cache, no request.
        assert judge.judge("Q?", "dark red", "red", "vstar") == 1.0
        again = _judge(server.url, store)  # a new client reads the store's cache
        assert again.judge("Q?", "dark red", "red", "vstar") == 1.0
    finally:
        server.close()
    assert len(server.requests) == 2
    assert server.requests[0]["temperature"] == 0.3
    assert judge.stats()["cache_hits"] == 1 and again.stats()["cache_hits"] == 1


def test_judge_outage_falls_back_and_is_counted():
    judge = _judge("http://127.0.0.1:9", retries=2)
    assert judge.judge("Q", "a", "b", "x") is None
    stats = judge.stats()
    assert stats["requests"] == 3 and stats["fallbacks"] == 1
    r = compute_reward(Task(id="t", data_source="wemath", question="Find x", answer="\\frac{1}{2}",
                            answer_type="math"), "0.5", answer_chars=3, successful_tool_calls=1,
                       well_formed=True, cfg=RewardConfig(judge=JudgeConfig(base_url="http://127.0.0.1:9")),
                       judge=judge)
    assert r.judge_fallback and not r.judged and r.correct  # math-verify decided


def test_judge_garbage_and_500s():
    server = judge_server([(500, ""), (200, "I think they match"), (200, "Judgement: 1")])
    try:
        judge = _judge(server.url, retries=1)
        assert judge.judge("Q", "a", "b", "x") is None  # 500 then unreadable
        assert judge.stats()["unreadable"] == 1
    finally:
        server.close()


def test_judge_prompt_families_never_crash():
    assert family_of("vstar") == "visual_search" and family_of("VSI-Bench") == "vsi"
    assert family_of("totally-unknown-source") == "generic"
    assert "Judgement: 1" in judge_prompt("q", "a", "b", "mathverse")


# -- strategy -----------------------------------------------------------------------------------


def group(i, rewards, broken=(), images=None):
    return Group(i, f"t{i}", [Rollout(r, broken[k] if k < len(broken) else None,
                                      True if images is None else images[k])
                              for k, r in enumerate(rewards)])


def test_zero_variance_and_broken_are_dropped_with_reasons():
    groups = [group(0, [1, 1, 1, 1]), group(1, [0, 1, 0, 1], broken=[None, None, "context_overflow"]),
              group(2, [0, 0, 0, 1])]
    sel = select_groups(groups, 8, StrategyConfig())
    assert [g.prompt_index for g, _ in sel.kept] == [1, 2]  # std 0.577 > 0.5
    assert sel.kept[0][1] == [0, 1, 3]
    assert sel.dropped == {"zero_variance": 1, "broken:context_overflow": 1}
    m = sel.metrics()
    assert m["strategy/kept_groups"] == 2 and m["strategy/dropped_broken_context_overflow"] == 1


def test_ranking_keeps_whole_groups_and_breaks_ties_by_index():
    groups = [group(3, [0, 1]), group(1, [0, 1]), group(2, [0, 0.2]), group(0, [0, 0.5])]
    sel = select_groups(groups, 2, StrategyConfig())
    assert [g.prompt_index for g, _ in sel.kept] == [1, 3]  # equal std: lower index first
    assert all(len(idx) == 2 for _, idx in sel.kept)  # never split
    assert sel.dropped["rank_cut"] == 2


def test_switches_for_ablations():
    groups = [group(0, [1, 1]), group(1, [0, 0.1]), group(2, [0, 1], broken=["image_limit"])]
    off = StrategyConfig(filter_zero_variance=False, filter_broken=False, rank_by_std=False)
    sel = select_groups(groups, 2, off)
    assert [g.prompt_index for g, _ in sel.kept] == [0, 1] and sel.dropped == {"rank_cut": 1}
    no_image = select_groups([group(0, [0, 1], images=[False, True])], 4,
                             StrategyConfig(filter_no_image=True))
    assert no_image.kept[0][1] == [1] and no_image.dropped["no_image"] == 1


def test_all_broken_group_is_empty():
    sel = select_groups([group(0, [0, 1], broken=["malformed", "malformed"])], 4, StrategyConfig())
    assert sel.kept == [] and sel.dropped["empty"] == 1


def test_selector_generates_until_enough_survive():
    sel = Selector(2, StrategyConfig(max_rounds=5))
    sel.add([group(0, [1, 1]), group(1, [0, 1])])
    assert not sel.ready
    sel.add([group(2, [0, 1])])
    assert sel.ready and [g.prompt_index for g, _ in sel.select().kept] == [1, 2]
    capped = Selector(10, StrategyConfig(max_rounds=1))
    capped.add([group(0, [0, 0])])
    assert capped.ready and capped.select().kept == []


def test_broken_reason_mapping():
    assert broken_reason("context_overflow", None) == "context_overflow"
    assert broken_reason("no_code_nor_answer", None) == "malformed"
    assert broken_reason("max_turns", None) is None and broken_reason("tool_error", None) is None
    assert broken_reason("answered", "3") is None


# -- algorithm vs verl ---------------------------------------------------------------------------


def _verl_advantages(rewards, norm_by_std):
    """verl's own GRPO outcome advantage, one scalar reward per response on its last token."""
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]])[: len(rewards)]
    scores = torch.zeros_like(mask, dtype=torch.float32)
    for i, r in enumerate(rewards):
        scores[i, int(mask[i].sum()) - 1] = r
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=mask.float(),
        index=np.array(["g"] * len(rewards), dtype=object), norm_adv_by_std_in_grpo=norm_by_std)
    assert (adv * (1 - mask)).abs().sum() == 0  # nothing on padding
    return adv[:, 0].tolist()


@pytest.mark.parametrize("rewards", [[1, 0, 0, 1], [1.2, -0.5, 0.0, 1.1, 0.3]])
def test_group_advantages_match_verl(rewards):
    # The engine's advantages (the ones that train) against verl's implementation.
    g = group(0, rewards)
    assert g.advantages(False) == pytest.approx(_verl_advantages(rewards, False), rel=1e-5)
    assert g.advantages(True) == pytest.approx(_verl_advantages(rewards, True), rel=1e-5)
    assert g.advantages(False)[:4] != pytest.approx(g.advantages(True)[:4])


def test_policy_loss_matches_hand_computation():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.1, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = policy_loss(old, new, adv, mask, AlgorithmConfig())
    ratio = new.exp()
    clipped = ratio.clamp(0.8, 1.2)
    per_tok = torch.maximum(-adv * ratio, -adv * clipped)
    expected = (per_tok * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert 0 < metrics["pg_clipfrac"] <= 1
    # Observation tokens (mask 0) have no effect whatever their values.
    new2 = new.clone()
    new2[0, 2] = 5.0
    assert policy_loss(old, new2, adv, mask, AlgorithmConfig())[0].item() == pytest.approx(loss.item())


def test_kl_is_zero_for_identical_policies():
    lp = torch.randn(2, 4)
    assert kl_loss(lp, lp, torch.ones(2, 4), AlgorithmConfig()).item() == pytest.approx(0.0, abs=1e-6)


def test_judge_outage_cools_down_then_retries():
    judge = _judge("http://127.0.0.1:9", retries=1)
    assert judge.judge("Q", "a", "b", "x") is None
    assert judge.stats()["requests"] == 2
    # Down: the next calls fall back at once instead of paying the retries again.
    assert judge.judge("Q", "c", "d", "x") is None and judge.judge("Q", "e", "f", "x") is None
    stats = judge.stats()
    assert stats["requests"] == 2 and stats["skipped"] == 2 and stats["fallbacks"] == 3
    # After the cool-down the endpoint is tried again (and answers now).
    server = judge_server([(200, "Judgement: 1")])
    try:
        judge.url = f"{server.url}/v1"
        judge._down_until = 0.0  # as if OUTAGE_COOLDOWN_S had passed
        assert judge.judge("Q", "g", "h", "x") == 1.0
    finally:
        server.close()
    assert judge.stats()["requests"] == 3
