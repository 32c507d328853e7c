"""The verl engine, CPU side: ranking sampler, reward entry, Hydra overrides, launch and dry run."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipelines.config.recipe import RECIPES_DIR, load_recipe
from pipelines.config.rl import StrategyConfig
from pipelines.core.records import Task
from pipelines.rl.verl.overrides import VerlPaths, render, render_overrides
from pipelines.rl.verl.reward import TERMS
from tests.helpers import REPO, FakeOpenAI, chat_completion

# -- a TransferQueue stand-in ------------------------------------------------------------------
# verl's v1 ReplayBuffer talks to TransferQueue (not installed on CPU machines; verl[vllm] brings
# it). This in-memory stand-in implements the calls the buffer makes, with the key/tag/field model
# of the real one: trajectories under `{uid}_{session}_{index}`, prompts under `{uid}` with tags.


@dataclasses.dataclass
class KVBatchMeta:
    partition_id: str
    keys: list[str]
    tags: list[dict]
    extra_info: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)


class FakeTQ(types.ModuleType):
    KVBatchMeta = KVBatchMeta

    def __init__(self) -> None:
        super().__init__("transfer_queue")
        self.parts: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.after_list: list = []

    def kv_list(self, partition_id: str | None = None) -> dict:
        out = {p: {k: dict(v["tag"]) for k, v in items.items()} for p, items in self.parts.items()
               if partition_id in (None, p)}
        hooks, self.after_list = self.after_list, []
        for hook in hooks:
            hook()
        return out

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict:
        return {f: [self.parts[partition_id][k]["fields"][f] for k in keys] for f in select_fields}

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        for k in keys:
            self.parts[partition_id].pop(k, None)


class Rollouts:
    """Plays the agent-loop workers: each submitted prompt becomes the next scripted group."""

    def __init__(self, tq: FakeTQ, groups: list[list[tuple[float, dict]]], *, running: bool = False):
        self.tq, self.groups, self.running, self.submitted = tq, list(groups), running, 0

    def submit(self, n: int) -> int:
        for _ in range(n):
            index = self.submitted
            uid = f"p{index:03d}"
            self.submitted += 1
            status = "running" if self.running else "finished"
            self.tq.parts["train"][uid] = {"tag": {"is_prompt": True, "status": status,
                                                   "global_steps": 1}, "fields": {}}
            for s, (reward, extra) in enumerate(self.groups.pop(0)):
                outputs = extra.pop("_outputs", 1)
                for i in range(outputs):
                    self.tq.parts["train"][f"{uid}_{s}_{i}"] = {
                        "tag": {"status": "success", "seq_len": 10 + s},
                        "fields": {"rm_scores": torch.tensor([0.0, 0.0, reward if i == outputs - 1
                                                              else 0.0]),
                                   "extra_fields": {"reward_extra_info": {"accuracy": float(reward > 0),
                                                                          "correct": float(reward > 0)},
                                                    **extra},
                                   "index": torch.tensor(index)}}
            if self.running:
                def finish(uid: str = uid) -> None:
                    self.tq.parts["train"][uid]["tag"]["status"] = "finished"
                self.tq.after_list.append(finish)
        return n


# Modules that bind `transfer_queue` at import: forgotten after each test, so none keeps the stand-in.
TQ_BOUND = ("transfer_queue", "verl.trainer.ppo.v1", "verl.trainer.ppo.padding_utils",
            "verl.utils.transferqueue_utils", "pipelines.rl.verl.ranking")


@pytest.fixture()
def ranking():
    """pipelines.rl.verl.ranking imported against the stand-in (and forgotten afterwards)."""
    tq = FakeTQ()
    before = dict(sys.modules)
    for name in [n for n in sys.modules if n.startswith(TQ_BOUND)]:
        del sys.modules[name]
    sys.modules["transfer_queue"] = tq
    module = importlib.import_module("pipelines.rl.verl.ranking")
    yield module, tq
    for name in [n for n in sys.modules if n.startswith(TQ_BOUND)]:
        del sys.modules[name]
    sys.modules.update({n: m for n, m in before.items() if n.startswith(TQ_BOUND)})


def _buffer(module, rollouts: Rollouts, **kwargs):
    sampler_kwargs = {"oversample_factor": 2.0, "filter_zero_variance": True, "filter_broken": True,
                      "filter_no_image": False, "rank_by_std": True, "gen_batch_size": 1,
                      "max_rounds": 3, "poll_s": 0.01, **kwargs}
    return module.PyVisionReplayBuffer(trainer_mode="sync", trainer_config={},
                                       max_off_policy_threshold=None,
                                       max_off_policy_strategy="drop",
                                       sampler_kwargs=sampler_kwargs, refill_fn=rollouts.submit)


def ok(reward: float, **extra: Any) -> tuple[float, dict]:
    return reward, {"stop_reason": "answered", "final_answer": "A", "produced_image": True,
                    "tool_calls": 2, "successful_calls": 1, "assistant_turns": 3, **extra}


def test_oversample_filter_rank_keeps_whole_groups(ranking):
    module, tq = ranking
    groups = [
        [ok(1.0)] * 4,                                      # index 0: zero variance
        [ok(1.0), ok(0.0), ok(0.0), ok(0.0)],               # index 1: std 0.5
        [ok(1.3), ok(0.0), ok(1.3, _outputs=2), ok(0.0)],   # index 2: std 0.75, a 2-output session
        [ok(0.0), ok(1.0), ok(0.0), ok(0.0)],               # index 3: std 0.5, ties with index 1
    ]
    rollouts = Rollouts(tq, groups, running=True)
    buffer = _buffer(module, rollouts)
    rollouts.submit(2)  # what the trainer submits for a batch of 2 prompts
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert rollouts.submitted == 4  # oversampled to ceil(2.0 x 2) prompts
    # Highest std first; the tie between indices 1 and 3 goes to the lower index; whole groups.
    assert batch.keys == ["p002_0_0", "p002_1_0", "p002_2_0", "p002_2_1", "p002_3_0",
                          "p001_0_0", "p001_1_0", "p001_2_0", "p001_3_0"]
    assert [t["seq_len"] for t in batch.tags[:2]] == [10, 11]
    assert metrics["strategy/kept_groups"] == 2 and metrics["strategy/kept_trajectories"] == 8
    assert metrics["strategy/dropped_zero_variance"] == 1 and metrics["strategy/dropped_rank_cut"] == 1
    assert metrics["strategy/generated_groups"] == 4 and metrics["strategy/rounds"] == 1
    assert metrics["reward/mean"] == pytest.approx((4 + 1 + 2.6 + 1) / 16)
    assert metrics["accuracy"] == pytest.approx(8 / 16) and metrics["tool_calls/mean"] == 2
    assert metrics["stop/answered"] == 1.0
    # Only the batch's trajectories stay in TransferQueue (the trainer clears them after the step).
    assert sorted(tq.parts["train"]) == sorted(batch.keys)


def test_broken_rollouts_dropped_and_another_round_fills_the_batch(ranking):
    module, tq = ranking
    groups = [
        [ok(1.0), ok(0.0, stop_reason="context_overflow"), ok(0.0), ok(0.0)],
        [ok(1.0), ok(0.0, final_answer=""), ok(0.0, stop_reason="image_limit"),
         ok(0.0, stop_reason="context_overflow")],          # one rollout left: dropped
        [ok(0.0), ok(1.0), ok(0.0), ok(1.0)],
    ]
    rollouts = Rollouts(tq, groups)
    buffer = _buffer(module, rollouts, oversample_factor=1.0)
    rollouts.submit(2)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert rollouts.submitted == 3 and metrics["strategy/rounds"] == 2
    assert batch.keys == ["p002_0_0", "p002_1_0", "p002_2_0", "p002_3_0",  # std 0.58 first
                          "p000_0_0", "p000_2_0", "p000_3_0"]  # its broken rollout 1 is out
    assert metrics["strategy/dropped_broken_context_overflow"] == 2
    assert metrics["strategy/dropped_broken_image_limit"] == 1
    assert metrics["strategy/dropped_broken_malformed"] == 1
    assert metrics["strategy/dropped_single_rollout"] == 1
    assert metrics["strategy/dropped_rank_cut"] == 0  # the lone rollout never took a place
    assert sorted(tq.parts["train"]) == sorted(batch.keys)


def test_ranking_does_not_depend_on_arrival_order(ranking):
    module = ranking[0]
    trajs = {}
    for uid, index, rewards in (("zz", 0, [1, 0]), ("aa", 1, [1, 0]), ("mm", 2, [0, 0])):
        for s, r in enumerate(rewards):
            trajs[f"{uid}_{s}_0"] = {"reward": r, "index": index,
                                     "extra_fields": {"stop_reason": "answered", "final_answer": "x"}}
    cfg = StrategyConfig()
    forward = module.choose(module.build_groups(trajs), 1, cfg)
    backward = module.choose(module.build_groups(dict(reversed(list(trajs.items())))), 1, cfg)
    assert forward.kept_uids == backward.kept_uids == ["zz"]  # tie on std: lower dataset index
    assert forward.drop_uids == {"aa", "mm"}


def test_nothing_survives_is_an_error_that_names_the_filters(ranking):
    module, tq = ranking
    rollouts = Rollouts(tq, [[ok(0.0)] * 2 for _ in range(3)])
    buffer = _buffer(module, rollouts, oversample_factor=1.0)
    rollouts.submit(1)
    with pytest.raises(RuntimeError, match="no group survived.*3 generation rounds.*zero_variance"):
        buffer.sample(global_steps=1, partition_id="train", batch_size=1)


def test_sampler_refuses_async_modes(ranking):
    module = ranking[0]
    with pytest.raises(ValueError, match="trainer_mode=sync"):
        module.PyVisionReplayBuffer(trainer_mode="colocate_async", trainer_config={},
                                    max_off_policy_threshold=None, max_off_policy_strategy="drop",
                                    sampler_kwargs={}, refill_fn=lambda n: n)


# -- overrides ---------------------------------------------------------------------------------


SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def compose_verl(overrides: list[str]):
    """verl's own trainer config (ppo_trainer.yaml and its defaults) with ``overrides``."""
    from hydra import compose, initialize_config_dir

    root = importlib.util.find_spec("verl").submodule_search_locations[0]
    with initialize_config_dir(config_dir=str(Path(root) / "trainer" / "config"), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


@pytest.mark.parametrize("name", SHIPPED)
def test_overrides_compose_against_verls_config(name, tmp_path):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    recipe = load_recipe(RECIPES_DIR / f"{name}.yaml", ("rl.verl.extra_overrides=[trainer.save_freq=7]",))
    paths = VerlPaths(tmp_path / "runs" / name / "rl")
    pairs = render(recipe, model=recipe.model.base, paths=paths, has_val=True, resume=False)
    # Composition itself rejects an unknown key (and a '+' key that verl already declares).
    cfg = compose_verl(render_overrides(recipe, model=recipe.model.base, paths=paths,
                                        has_val=True, resume=False))
    for o in pairs:
        got = OmegaConf.select(cfg, o.key, throw_on_missing=True)
        got = list(got) if OmegaConf.is_list(got) else got
        expected = 7 if o.key == "trainer.save_freq" else o.value  # extra overrides come last
        assert got == expected and type(got) is type(expected), o
    assert len({o.key for o in pairs}) == len(pairs)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert not need_reference_policy(cfg) and not need_critic(cfg)  # no KL, no critic
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.limit_images == recipe.agent.max_images and rollout.multi_turn.enable
    if name.startswith("pyvision-"):  # the paper's settings, spelled out
        actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
        assert (cfg.actor_rollout_ref.rollout.n, actor.optim.lr, actor.optim.lr_scheduler_type,
                actor.optim.lr_warmup_steps_ratio) == (8, 1e-6, "constant", 0.0)
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == \
            (0.2, 0.2, "token-mean")
        assert (actor.use_kl_loss, actor.kl_loss_coef, actor.entropy_coeff) == (False, 0.0, 0.0)
        assert (algo.adv_estimator, algo.norm_adv_by_std_in_grpo, algo.use_kl_in_reward) == \
            ("grpo", False, False)
        assert actor.freeze_vision_tower is True
        assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 5
        assert cfg.actor_rollout_ref.rollout.max_model_len == 32768
        assert (cfg.data.train_batch_size, actor.ppo_mini_batch_size, cfg.data.gen_batch_size) == \
            (64, 16, 64)
        assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.trainer.total_epochs,
                cfg.trainer.test_freq) == (1, 8, 5, 20)
    assert cfg.actor_rollout_ref.rollout.mode == "async"
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(paths.agent_loop)
    assert cfg.trainer.default_local_dir == str(paths.checkpoints)
    assert "file" in cfg.trainer.logger and cfg.trainer.resume_mode == "disable"
    assert cfg.reward.custom_reward_function.reward_kwargs.recipe == str(paths.recipe)
    assert cfg.trainer.v1.sampler.sampler_kwargs.oversample_factor == \
        recipe.rl.strategy.oversample_factor


def test_override_values_survive_hydra_quoting(tmp_path):
    weird = tmp_path / "my runs" / "it's=here,[x]" / "rl"
    recipe = load_recipe(None, ("rl.verl.nnodes=2",))
    cfg = compose_verl(render_overrides(recipe, model="/models/a b", paths=VerlPaths(weird),
                                        has_val=False, resume=True))
    assert cfg.data.train_files == str(weird / "data" / "train.parquet")
    assert cfg.data.val_files == cfg.data.train_files and cfg.trainer.test_freq == -1
    assert cfg.actor_rollout_ref.model.path == "/models/a b" and cfg.trainer.nnodes == 2
    assert cfg.trainer.resume_mode == "auto" and cfg.trainer.val_before_train is False


def test_the_optimizer_reaches_verl_as_the_local_engine_builds_it(tmp_path):
    """``rl.optimizer`` renders to verl's ``actor.optim`` keys, and verl's FSDP actor config
    composed from them builds the same optimizer the local engine builds."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.optimizer import build_optimizer as verl_build

    from pipelines.rl.algos import build_optimizer

    recipe = load_recipe(None, ("rl.optimizer.name=SGD", "rl.optimizer.weight_decay=0.05",
                                "rl.optimizer.grad_clip=0.5",
                                "rl.optimizer.args={momentum: 0.9, nesterov: true}"))
    cfg = compose_verl(render_overrides(recipe, model="m", paths=VerlPaths(tmp_path / "rl"),
                                        has_val=False, resume=False))
    optim = cfg.actor_rollout_ref.actor.optim
    assert (optim.optimizer, optim.optimizer_impl, optim.weight_decay, optim.clip_grad) == \
        ("SGD", "torch.optim", 0.05, 0.5)
    assert OmegaConf.to_container(optim.override_optimizer_config) == \
        {"momentum": 0.9, "nesterov": True}
    param = torch.nn.Parameter(torch.zeros(2))
    theirs = verl_build([param], omega_conf_to_dataclass(optim))
    ours = build_optimizer([param], recipe.rl)
    assert type(theirs) is type(ours) is torch.optim.SGD
    keep = ("lr", "momentum", "nesterov", "weight_decay", "dampening")
    assert {k: theirs.defaults[k] for k in keep} == {k: ours.defaults[k] for k in keep}


# -- reward through verl's naive reward manager --------------------------------------------------


def _judge_server(verdict: str) -> FakeOpenAI:
    return FakeOpenAI(lambda body: (200, chat_completion(verdict)))


def _row(task: Task, tokenizer, text: str, loop_fields: dict | None):
    """One trajectory as verl's agent loop hands it to the reward worker (agent_loop._compute_score)."""
    from tensordict import TensorDict
    from verl import DataProto

    prompt = torch.tensor(tokenizer.encode("question"), dtype=torch.int64)
    response = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    ids = torch.cat([prompt, response])
    batch = TensorDict({"prompts": prompt[None], "responses": response[None],
                        "attention_mask": torch.ones_like(ids)[None], "input_ids": ids[None],
                        "position_ids": torch.arange(len(ids))[None]}, batch_size=1)
    extra_info = {"index": 0, "split": "train", "task": task.model_dump_json(), "media_root": "/"}
    non_tensor = {"data_source": np.array([task.data_source], dtype=object),
                  "reward_model": np.array([{"style": "rule", "ground_truth": task.answer}]),
                  "extra_info": np.array([extra_info]), "__num_turns__": np.array([5])}
    if loop_fields is not None:
        non_tensor["tool_extra_fields"] = np.array([loop_fields], dtype=object)
    return DataProto(batch=batch, non_tensor_batch=non_tensor)


def test_reward_entry_through_verls_naive_reward_manager(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import load_reward_manager

    server = _judge_server("Judgement: 1")
    try:
        recipe = load_recipe(RECIPES_DIR / "pyvision-image-7b.yaml",
                             (f"reward.judge.base_url={server.url}",))
        paths = VerlPaths(tmp_path / "runs" / "r" / "rl")
        paths.stage.mkdir(parents=True)
        paths.recipe.write_text(json.dumps(recipe.model_dump(mode="json")))  # YAML is a JSON superset
        cfg = compose_verl(render_overrides(recipe, model=str(tiny_model_dir), paths=paths,
                                            has_val=False, resume=False))
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        manager = load_reward_manager(cfg, tokenizer)
        assert type(manager).__name__ == "NaiveRewardManager"

        def score(task, text, fields):
            out = manager.loop.run_until_complete(manager.run_single(_row(task, tokenizer, text, fields)))
            assert set(out["reward_extra_info"]) == set(TERMS)  # the same keys for every sample
            assert out["reward_score"] == out["reward_extra_info"]["score"]
            return out["reward_extra_info"]

        choice = Task(id="c", data_source="vstar", question="Colour?\n(A) red\n(B) blue",
                      answer="B", answer_type="choice", options=["red", "blue"])
        loop = {"final_answer": "B", "well_formed": True, "answer_chars": 12, "successful_calls": 3,
                "tool_calls": 4, "stop_reason": "answered"}
        r = score(choice, "ignored", loop)
        assert r["score"] == pytest.approx(1.3) and (r["accuracy"], r["tool"]) == (1.0, pytest.approx(0.3))
        assert r["parsed_from_text"] == 0.0 and r["judged"] == 0.0  # choices use the rule verifier
        assert score(choice, "", dict(loop, final_answer="A"))["score"] == 0.0  # no tool bonus
        r = score(choice, "", dict(loop, answer_chars=5000))
        assert (r["score"], r["length_guard"]) == (0.0, 1.0)  # the guard zeroes the tool bonus too
        r = score(choice, "", dict(loop, final_answer="", well_formed=False))
        assert (r["score"], r["format"], r["correct"]) == (0.0, 0.0, 0.0)
        # Without the loop's fields the answer is parsed from the decoded text; an answer printed by
        # the code inside <interpreter> is not the model's, and a failed call earns no bonus.
        text = ("<code>\n```python\nprint(1)\n```\n</code><interpreter>\nText Result:\n"
                "<answer>\\boxed{A}</answer>\n</interpreter><code>\n```python\nx\n```\n</code>"
                "<interpreter>\nText Result:\nNone\nError (error):\nNameError\n</interpreter>"
                "It is blue.\n<answer>\n\\boxed{B}\n</answer>")
        r = score(choice, text, None)
        assert (r["score"], r["parsed_from_text"]) == (pytest.approx(1.1), 1.0)
        # Free-text answers of a training set go to the judge (a test server that says
        # "consistent"); a benchmark's task is scored as its evaluation scores it (rules here).
        text_task = Task(id="t", data_source="deepeyes/visual_search",
                         question="What is left of the cup?", answer="a small red ball",
                         answer_type="text")
        r = score(text_task, "", dict(loop, final_answer="the red sphere", successful_calls=1))
        assert (r["score"], r["judged"], r["judge_fallback"]) == (pytest.approx(1.1), 1.0, 0.0)
        synth_text = text_task.model_copy(update={"data_source": "synth/image-search"})
        r = score(synth_text, "", dict(loop, final_answer="the red sphere", successful_calls=1))
        assert (r["score"], r["judged"]) == (0.0, 0.0)
    finally:
        server.close()


# -- launch: dry run through the CLI, the subprocess path with a fake interpreter -----------------

FAKE_VERL = '''#!{python}
import json, os, pathlib, sys, time
if sys.argv[1] == "-c":  # the launcher's interpreter check
    print(json.dumps({{"python": "3.11", "verl": "0.9.1", "backend": True, "transfer_queue": True}}))
    sys.exit(0)
assert sys.argv[1:3] == ["-m", "verl.trainer.main_ppo"], sys.argv
args = dict(a.lstrip("+").split("=", 1) for a in sys.argv[3:])
log = pathlib.Path(os.environ["VERL_FILE_LOGGER_PATH"])
assert str(log) == args["ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"]
pathlib.Path("fake_env.json").write_text(json.dumps(
    {{"RAY_ADDRESS": os.environ.get("RAY_ADDRESS"), "PYTHONPATH": os.environ.get("PYTHONPATH"),
      "cwd": os.getcwd(), "args": args}}))
for i in range({noise}):
    print(f"(TaskRunner pid=1) noise line {{i}}", flush=True)
if {code}:
    print("RuntimeError: CUDA out of memory", flush=True)
    sys.exit({code})
ckpt = pathlib.Path(args["trainer.default_local_dir"])
tracker = ckpt / "latest_checkpointed_iteration.txt"
start = int(tracker.read_text()) if args["trainer.resume_mode"] == "auto" and tracker.exists() else 0
print("Total training steps: 3", flush=True)
with open(log, "wb", buffering=0) as fh:  # as verl's FileLogger opens it
    for step in range(start + 1, 4):
        data = {{"critic/score/mean": step / 10, "actor/pg_loss": -step, "strategy/kept_groups": 4,
                 "flag": True, "hist": [1, 2]}}
        fh.write((json.dumps({{"step": step, "data": data}}) + "\\n").encode())
        time.sleep(0.05)
        actor = ckpt / f"global_step_{{step}}" / "actor"
        actor.mkdir(parents=True, exist_ok=True)
        (actor / "fsdp_config.json").write_text("{{}}")
        tracker.write_text(str(step))
'''


def _fake_verl(tmp_path: Path, *, code: int = 0, noise: int = 3) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_VERL.format(python=sys.executable, code=code, noise=noise))
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def rl_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipelines.data.synth import synthesize

    out = tmp_path_factory.mktemp("rl-tasks") / "img"
    synthesize("image-search", 3, 0, out, progress=False)
    return out


def test_dry_run_through_the_cli(rl_tasks, tiny_model_dir, tmp_path):
    import shlex
    import stat

    import yaml
    from typer.testing import CliRunner

    from pyvision_cli.main import app

    result = CliRunner().invoke(app, [
        "rl", "-c", str(RECIPES_DIR / "pyvision-image-7b.yaml"), "--engine", "verl", "--dry-run",
        "--json", "--model", str(tiny_model_dir), "--tasks", str(rl_tasks),
        "--set", f"runs_dir={tmp_path / 'runs'}", "--set", "agent.image_max_pixels=50176"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    stage = tmp_path / "runs" / "pyvision-image-7b" / "rl"
    assert set(plan) == {"command", "overrides", "run_dir"} and plan["run_dir"] == str(stage)
    assert plan["command"][1:3] == ["-m", "verl.trainer.main_ppo"]
    assert plan["command"][3:] == plan["overrides"]
    cfg = compose_verl(plan["overrides"])  # what the CLI printed is a valid verl configuration
    assert cfg.actor_rollout_ref.model.path == str(tiny_model_dir)
    assert cfg.data.train_files == str(stage / "data" / "train.parquet")
    assert cfg.data.val_files == cfg.data.train_files and cfg.trainer.test_freq == -1  # no val set
    # launch.sh is executable and runs exactly the printed command.
    script = stage / "launch.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    text = script.read_text()
    exec_part = text[text.index("exec "):].replace("\\\n", " ")
    assert shlex.split(exec_part)[1:] == plan["command"]
    assert f"export VERL_FILE_LOGGER_PATH={stage / 'verl_metrics.jsonl'}" in text
    assert subprocess_ok(["bash", "-n", str(script)])
    # The agent-loop registry names V1's class and the run's resolved recipe.
    entries = yaml.safe_load((stage / "agent_loop.yaml").read_text())
    assert entries == [{"name": "pyvision_agent",
                        "_target_": "pipelines.rl.verl.agent_loop.PyVisionAgentLoop",
                        "recipe": str(stage / "config.yaml")}]
    written = load_recipe(stage / "config.yaml")
    assert written.rl.engine == "verl" and written.agent.image_max_pixels == 50176
    import pyarrow.parquet as pq

    assert pq.read_table(stage / "data" / "train.parquet").num_rows == 3
    assert not (stage / "verl.log").exists() and not (stage / "manifest.json").exists()
    # Without --json the command is printed too (it printed nothing at all before).
    again = CliRunner().invoke(app, [
        "rl", "-c", str(RECIPES_DIR / "pyvision-image-7b.yaml"), "--engine", "verl", "--dry-run",
        "--model", str(tiny_model_dir), "--tasks", str(rl_tasks),
        "--set", f"runs_dir={tmp_path / 'runs'}", "--set", "agent.image_max_pixels=50176"])
    assert again.exit_code == 0, again.output
    assert shlex.split(again.stdout.strip()) == plan["command"]
    assert f"wrote the launch files to {stage}" in again.stderr


def test_dry_run_rewrites_an_unstarted_stage_but_never_a_begun_one(rl_tasks, tmp_path):
    from pipelines.errors import UserError
    from pipelines.rl.verl.launch import launch_verl

    recipe, sd = _stage(tmp_path)
    other, sd_other = _stage(tmp_path, "rl.n=4")  # the same run id and stage, another config
    launch_verl(recipe, sd, model="m", task_dirs=[rl_tasks], dry_run=True)
    plan = launch_verl(other, sd_other, model="m", task_dirs=[rl_tasks], dry_run=True)
    assert "actor_rollout_ref.rollout.n=4" in plan["overrides"]
    assert load_recipe(sd.path / "config.yaml").rl.n == 4  # what the loop and reward will read
    # Like any re-run with another config, a real run of rl.n=8 is refused until --force ...
    with pytest.raises(UserError, match="different config.*--force"):
        sd.begin()
    sd.begin(force=True)
    assert load_recipe(sd.path / "config.yaml").rl.n == 8
    # ... and once a stage has begun, its config.yaml is the record: a dry run never rewrites it.
    with pytest.raises(UserError, match="different config"):
        launch_verl(other, sd_other, model="m", task_dirs=[rl_tasks], dry_run=True)
    assert load_recipe(sd.path / "config.yaml").rl.n == 8


def subprocess_ok(argv: list[str]) -> bool:
    import subprocess

    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def _stage(tmp_path: Path, *sets: str):
    from pipelines.rundir import stage_dir
    from pipelines.store import Store

    recipe = load_recipe(RECIPES_DIR / "pyvision-image-7b.yaml",
                         ("agent.image_max_pixels=50176", *sets))
    sd = stage_dir(recipe, "rl", "fake", runs_dir=tmp_path / "runs", store=Store())
    return recipe, sd


def test_launch_streams_metrics_and_finishes_with_checkpoints(rl_tasks, tmp_path):
    from pipelines.merge import _find_actor_dir
    from pipelines.rl.stage import run_rl

    recipe, sd = _stage(tmp_path, f"rl.verl.python={_fake_verl(tmp_path)}",
                        "rl.verl.ray_address=auto")
    sd.begin()
    stale = sd.path / "checkpoints" / "global_step_99" / "actor"
    stale.mkdir(parents=True)  # from an earlier run: a fresh run must not merge it
    summary = run_rl(recipe, sd, model="Qwen/Qwen2.5-VL-7B-Instruct", task_dirs=[str(rl_tasks)],
                     show_progress=False)
    assert (summary["steps"], summary["total_steps"], summary["checkpoint_step"]) == (3, 3, 3)
    rows = sd.store.metrics("fake", "rl")
    by_step = defaultdict(dict)
    for r in rows:
        by_step[r["step"]][r["name"]] = r["value"]
    assert sorted(by_step) == [1, 2, 3]
    assert by_step[2]["critic/score/mean"] == pytest.approx(0.2) and by_step[2]["loss"] == -2.0
    assert "flag" not in by_step[2] and "hist" not in by_step[2]  # only numbers are metrics
    outputs = sd.manifest().outputs
    assert outputs.checkpoints == str(sd.path / "checkpoints") and not stale.exists()
    # `pyvision merge --engine verl` (and the merge stage) finds the last step in that folder.
    assert _find_actor_dir(Path(outputs.checkpoints)) == sd.path / "checkpoints" / "global_step_3" / "actor"
    env = json.loads((sd.path / "fake_env.json").read_text())
    assert env["RAY_ADDRESS"] == "auto" and env["cwd"] == str(sd.path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert env["args"]["trainer.resume_mode"] == "disable"
    assert "Total training steps: 3" in (sd.path / "verl.log").read_text()

    # --resume: verl continues from its tracker; the store forgets what comes after it.
    (sd.path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    sd.store.log_metrics("fake", "rl", 3, {"stale": 1.0})
    data_mtime = (sd.path / "data" / "train.parquet").stat().st_mtime_ns
    summary = run_rl(recipe, sd, model="Qwen/Qwen2.5-VL-7B-Instruct", task_dirs=[str(rl_tasks)],
                     resume=True, show_progress=False)
    assert summary["resumed_from"] == 1 and summary["steps"] == 3
    names_at_3 = [r["name"] for r in sd.store.metrics("fake", "rl") if r["step"] == 3]
    assert "stale" not in names_at_3 and names_at_3.count("critic/score/mean") == 1
    assert (sd.path / "data" / "train.parquet").stat().st_mtime_ns == data_mtime  # same data


def test_launch_failure_shows_the_tail_and_the_log(rl_tasks, tmp_path, capsys):
    from pipelines.errors import SubprocessFailed

    recipe, sd = _stage(tmp_path, f"rl.verl.python={_fake_verl(tmp_path, code=3, noise=40)}")
    sd.begin()
    from pipelines.rl.verl.launch import launch_verl

    with pytest.raises(SubprocessFailed) as exc:
        launch_verl(recipe, sd, model="m", task_dirs=[rl_tasks], show_progress=False)
    assert "exit code 3" in str(exc.value) and str(sd.path / "verl.log") in str(exc.value)
    err = capsys.readouterr().err
    assert "CUDA out of memory" in err and "noise line 39" in err and "noise line 1\n" not in err
    assert "noise line 0" in (sd.path / "verl.log").read_text() and not sd.is_complete()


def test_interpreter_without_verl_or_vllm_is_a_user_error(rl_tasks, tmp_path):
    from pipelines.errors import UserError
    from pipelines.rl.verl.launch import check_interpreter, launch_verl

    recipe, sd = _stage(tmp_path, "rl.verl.python=/nonexistent/python")
    sd.begin()
    with pytest.raises(UserError, match=r"cannot run the verl interpreter.*install verl\[vllm\]"):
        launch_verl(recipe, sd, model="m", task_dirs=[rl_tasks], show_progress=False)
    assert (sd.path / "launch.sh").is_file()  # the files are written before the check
    # This CPU environment has verl 0.9.1 but neither vLLM nor TransferQueue.
    with pytest.raises(UserError, match=r"has no vllm.*install verl\[vllm\]==0\.9\.1 in a GPU"):
        check_interpreter(sys.executable, "vllm")


def test_dry_run_names_skipped_rows_in_one_readable_line(rl_tasks, tmp_path, monkeypatch, capsys):
    """The export's skipped rows reach the user as one line (count, reasons, the first row), not
    as a printed dict."""
    import pipelines.data.export_verl as export_module
    from pipelines.rl.verl.launch import launch_verl

    real = export_module.export_verl

    def with_a_skip(*args, **kwargs):  # one row dropped, as an over-long prompt is
        info = real(*args, **kwargs)
        return {**info, "skipped": {"prompt_too_long": 1},
                "problems": [f"{rl_tasks}/tasks.jsonl:3: prompt too long"]}

    monkeypatch.setattr(export_module, "export_verl", with_a_skip)
    recipe, sd = _stage(tmp_path)
    launch_verl(recipe, sd, model="m", task_dirs=[rl_tasks], dry_run=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    want = (f"warning: verl export skipped 1 row: 1 prompt_too_long; first: "
            f"{rl_tasks}/tasks.jsonl:3: prompt too long")
    assert lines == [want]


def test_reward_threads_starting_together_share_one_judge(tmp_path, monkeypatch):
    # verl's reward threads ask for the run's settings together; a judge each would multiply the
    # requests in flight past reward.judge.concurrency.
    import threading
    import time

    import pipelines.scoring.judge
    from pipelines.rl.verl import reward

    built: list[int] = []

    class SlowJudge:
        def __init__(self, cfg):
            built.append(1)
            time.sleep(0.2)

    monkeypatch.setattr(pipelines.scoring.judge, "Judge", SlowJudge)
    recipe = load_recipe(None, ["reward.judge.base_url=http://127.0.0.1:9/v1"])
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(recipe.model_dump(mode="json")))
    reward._load_settings.cache_clear()
    try:
        judges: list[object] = []
        threads = [threading.Thread(target=lambda: judges.append(reward._settings(str(path))[1]))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        reward._load_settings.cache_clear()
    assert len(built) == 1 and len({id(j) for j in judges}) == 1


def test_export_counts_prompt_tokens_with_a_transformers_5_processor(tiny_model_dir, capsys):
    # transformers 5 saves processor_config.json only; the export had read that as "no
    # processor", warned, and left prompt lengths to the agent loop.
    from pipelines.rl.verl.launch import _processor

    assert not (tiny_model_dir / "preprocessor_config.json").exists()
    assert _processor(str(tiny_model_dir)) is not None
    assert "not a local model folder" not in capsys.readouterr().err
