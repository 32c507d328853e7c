"""RL options of issue 26, each through the code that honours it: the zero-variance filter's
basis, over-turn masking (local engine and verl agent loop), the code-block temperature (local
sampling and the trainer's recomputation; refused by verl), and LoRA RL (peft adapters on the
language model only, merged by ``pyvision merge``; verl's FSDP LoRA settings)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from pipelines.config.recipe import RECIPES_DIR, load_recipe
from pipelines.config.rl import StrategyConfig
from pipelines.errors import UserError
from pipelines.rl.strategy import Group, Rollout, select_groups
from tests.pipelines.rl.verl import test_verl_guards

# The tiny Qwen2.5-VL's verl parts and a 900 x 600 image task, as the guard tests use them.
qwen25 = test_verl_guards.qwen25
big_image_task = test_verl_guards.big_image_task

# -- zero-variance basis --------------------------------------------------------------------------


def _groups() -> list[Group]:
    # g0 differs only in the shaped reward (both wrong); g1 in accuracy; g2 in nothing.
    return [Group(0, "t0", [Rollout(0.1, correct=0.0), Rollout(0.3, correct=0.0)]),
            Group(1, "t1", [Rollout(1.0, correct=1.0), Rollout(0.0, correct=0.0)]),
            Group(2, "t2", [Rollout(0.5, correct=1.0), Rollout(0.5, correct=1.0)])]


def test_zero_variance_filter_basis_and_both_counts():
    by_reward = select_groups(_groups(), 3, StrategyConfig())
    assert [g.task_id for g, _ in by_reward.kept] == ["t1", "t0"]  # ranked by reward std
    by_accuracy = select_groups(_groups(), 3, StrategyConfig(zero_variance_basis="accuracy"))
    assert [g.task_id for g, _ in by_accuracy.kept] == ["t1"]
    for sel in (by_reward, by_accuracy):
        m = sel.metrics()
        assert (m["strategy/groups_varying_reward"], m["strategy/groups_varying_accuracy"]) == (2, 1)
    assert by_accuracy.dropped["zero_variance"] == 2


# -- over-turn masking, local engine ----------------------------------------------------------------


def _traj(stop: str, n: int):
    trace = SimpleNamespace(input_ids=list(range(n + 2)), response_mask=[1] * n, prompt_len=2,
                            images=[], temperatures=[])
    return SimpleNamespace(stop_reason=stop, trace=trace)


@pytest.mark.parametrize("mask", [False, True])
def test_mask_truncated_leaves_cut_trajectories_out_of_the_loss(mask):
    from pipelines.rl.local import LocalEngine, RolloutBatch
    from pipelines.rl.strategy import Selection

    recipe = load_recipe(None, (f"rl.mask_truncated={str(mask).lower()}",))
    engine = LocalEngine.__new__(LocalEngine)
    engine.recipe = recipe
    trajs = [_traj("answered", 3), _traj("max_turns", 5), _traj("context_overflow", 4),
             _traj("answered", 2)]
    group = Group(0, "t0", [Rollout(1.0), Rollout(0.0), Rollout(0.0), Rollout(0.0)])
    batch = RolloutBatch(trajs, [], {0: trajs}, Selection(kept=[(group, [0, 1, 2, 3])]),
                         0.0, 0.0, 0.0)
    seqs, advs, _ = engine.training_batch(batch)
    adv = group.advantages(recipe.rl.algorithm.norm_adv_by_std)
    if mask:
        # The cut ones still set the group's mean (adv[0] is against all four rewards).
        assert [len(s.response_mask) for s in seqs] == [3, 2] and advs == [adv[0], adv[3]]
        assert batch.masked == 2
    else:
        assert len(seqs) == 4 and advs == adv and batch.masked == 0


# -- over-turn masking, verl agent loop -------------------------------------------------------------


def test_mask_truncated_in_the_verl_agent_loop(qwen25, big_image_task, tmp_path):
    from tests.pipelines.rl.verl.test_verl_agent_loop import (
        CODE_TURN,
        ScriptedServer,
        _encode,
        _row,
    )
    from tests.pipelines.rl.verl.test_verl_guards import _postprocess, _recipe, _run

    tok = qwen25["tokenizer"]
    row = _row(*big_image_task)
    code = _encode(tok, CODE_TURN)
    for mask in (False, True):
        recipe = _recipe(tmp_path, rl={"mask_truncated": mask}, max_turns_train=2)
        out = _run(qwen25, ScriptedServer(tok, [code] * 3), recipe, row)
        assert out.extra_fields["stop_reason"] == "max_turns"
        assert out.extra_fields["masked"] is mask
        assert (sum(out.response_mask) == 0) is mask
        _postprocess(qwen25, out, row)


# -- code-block temperature -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from pipelines.agent.policies.hf import HFPolicy

    return HFPolicy.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32",
                                    image_max_pixels=12544)


def test_opens_code_sees_a_completed_code_tag(policy):
    tok = policy.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    assert policy.tokens.opens_code(enc("Let me look closer.\n<code>"))
    assert not policy.tokens.opens_code(enc("Let me look closer."))
    assert not policy.tokens.opens_code(enc("x = 1\n</code>"))


def test_code_temperature_samples_and_trains_each_token_at_its_own(policy, monkeypatch):
    """Tokens after the code tag are sampled at code_temperature, recorded per token, and the
    trainer's log-probs reproduce the sampler's for every token (a single temperature would not)."""
    from pipelines.agent.policies.base import Sampling
    from pipelines.rl.logprobs import TokenSequence, sequence_logprobs

    # The random tiny model never writes "<code>": say the code opens after its 4th token.
    monkeypatch.setattr(policy.tokens, "opens_code", lambda toks: len(toks) == 4)
    img = Image.new("RGB", (200, 140), (200, 30, 40))
    handles = [policy.begin([{"role": "user", "content": [{"type": "image", "image": img},
                                                          {"type": "text", "text": q}]}])
               for q in ("How many?", "What colour is it?")]
    torch.manual_seed(0)
    policy.generate(handles, Sampling(12, 1.0, 1.0, code_temperature=0.3))
    seqs = []
    for h in handles:
        tr = policy.tokens.trace(h)
        n = len(tr.logprobs)
        assert tr.temperatures == [1.0] * min(n, 4) + [0.3] * max(0, n - 4)
        seqs.append(TokenSequence(tr.input_ids, tr.response_mask, tr.prompt_len, tr.images,
                                  tr.temperatures))
    assert any(len(s.temperatures) > 4 for s in seqs)
    with torch.no_grad():
        lp, _, mask = sequence_logprobs(policy.model, policy.processor, seqs, temperature=1.0)
        flat, _, _ = sequence_logprobs(policy.model, policy.processor,
                                       [TokenSequence(s.input_ids, s.response_mask, s.prompt_len,
                                                      s.images) for s in seqs], temperature=1.0)
    for i, h in enumerate(handles):
        got = lp[i][mask[i] > 0].tolist()
        assert got == pytest.approx(h.logprobs, abs=1e-4)
        assert flat[i][mask[i] > 0].tolist() != pytest.approx(h.logprobs, abs=1e-4)


def test_code_temperature_is_refused_by_verl_at_compose_time(tmp_path):
    from pipelines.rl.verl.overrides import VerlPaths, render

    recipe = load_recipe(None, ("agent.code_temperature=0.5",))
    assert recipe.agent.code_temperature == 0.5
    with pytest.raises(UserError, match="agent.code_temperature is not supported by the verl"):
        render(recipe, model="m", paths=VerlPaths(tmp_path / "rl"), has_val=False, resume=False)


# -- LoRA RL ---------------------------------------------------------------------------------------


def test_lora_overrides_compose_against_verls_config(tmp_path):
    from omegaconf import OmegaConf

    from pipelines.rl.verl.overrides import VerlPaths, render, render_overrides
    from tests.pipelines.rl.verl.test_verl_launch import compose_verl

    recipe = load_recipe(RECIPES_DIR / "pyvision-image-7b.yaml",
                         ("rl.lora.rank=16", "rl.lora.alpha=32"))
    paths = VerlPaths(tmp_path / "rl")
    pairs = {o.key: o.value for o in render(recipe, model="m", paths=paths, has_val=False,
                                              resume=False)}
    assert pairs["actor_rollout_ref.model.lora_rank"] == 16
    assert pairs["actor_rollout_ref.model.exclude_modules"] == ".*visual.*"
    cfg = compose_verl(render_overrides(recipe, model="m", paths=paths, has_val=False,
                                        resume=False))
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.exclude_modules) == (16, 32, ".*visual.*")
    assert list(OmegaConf.to_container(model.target_modules)) == list(recipe.rl.lora.target_modules)
    assert model.lora.merge is True  # rl.lora.merge_for_rollout, on by default
    unmerged = load_recipe(RECIPES_DIR / "pyvision-image-7b.yaml",
                           ("rl.lora.rank=16", "rl.lora.merge_for_rollout=false"))
    cfg = compose_verl(render_overrides(unmerged, model="m", paths=paths, has_val=False,
                                        resume=False))
    assert cfg.actor_rollout_ref.model.lora.merge is False
    off = {o.key for o in render(load_recipe(RECIPES_DIR / "pyvision-image-7b.yaml"), model="m",
                                 paths=paths, has_val=False, resume=False)}
    assert "actor_rollout_ref.model.lora_rank" not in off


def test_lora_adapts_the_language_model_only_and_merges(tiny_model_dir, tmp_path):
    from pipelines.core.modeldir import LORA_MARKER
    from pipelines.rl.local import attach_lora, load_policy_model, save_adapter
    from pipelines.sft.lora import merge_lora

    recipe = load_recipe(None, ("rl.lora.rank=4",))
    model, processor = load_policy_model(recipe, str(tiny_model_dir))
    peft_model = attach_lora(model, recipe.rl.lora)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("visual" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    save_adapter(peft_model, processor, tmp_path / "adapter", str(tiny_model_dir), recipe.rl.lora)
    assert json.loads((tmp_path / "adapter" / LORA_MARKER).read_text())["rank"] == 4
    info = merge_lora(tmp_path / "adapter", tiny_model_dir, tmp_path / "merged")
    assert info["full_load"] is True
    from transformers import AutoModelForImageTextToText

    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"),
                                                         dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_lora_targets_that_match_nothing_are_an_error(tiny_model_dir):
    from pipelines.rl.local import attach_lora, load_policy_model

    recipe = load_recipe(None, ("rl.lora.rank=4", "rl.lora.target_modules=[no_such_proj]"))
    model, _ = load_policy_model(recipe, str(tiny_model_dir))
    with pytest.raises((UserError, ValueError)):
        attach_lora(model, recipe.rl.lora)
