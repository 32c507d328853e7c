"""Recipe models: documented, bounded, frozen; overrides and unknown keys; shipped recipes."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from pipelines.config.base import Section
from pipelines.config.loader import apply_overrides, load_config
from pipelines.config.recipe import RECIPES_DIR, Recipe, load_recipe
from pipelines.errors import ConfigError


def _sections(model: type[BaseModel], seen: set | None = None) -> list[type[BaseModel]]:
    seen = seen if seen is not None else set()
    if model in seen:
        return []
    seen.add(model)
    out = [model]
    for field in model.model_fields.values():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out += _sections(arg, seen)
    return out


def _is_numeric(annotation) -> bool:
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else (annotation,)
    return any(a in (int, float) for a in args) and bool not in args


ALL_SECTIONS = _sections(Recipe)


def test_all_sections_are_frozen_strict_sections():
    assert len(ALL_SECTIONS) >= 10
    for model in ALL_SECTIONS:
        assert issubclass(model, Section), model
        assert model.model_config["frozen"] and model.model_config["extra"] == "forbid"


@pytest.mark.parametrize("model", ALL_SECTIONS, ids=lambda m: m.__name__)
def test_every_field_documented_and_numbers_bounded(model):
    for name, field in model.model_fields.items():
        assert field.description and len(field.description) > 10, f"{model.__name__}.{name} undocumented"
        if _is_numeric(field.annotation):
            bounds = [m for m in field.metadata
                      if type(m).__name__ in ("Ge", "Gt", "Le", "Lt", "Interval")]
            kinds = {type(m).__name__ for m in bounds}
            assert kinds & {"Ge", "Gt"} and kinds & {"Le", "Lt"}, \
                f"{model.__name__}.{name} needs lower and upper bounds"


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate_and_document_themselves(path: Path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    header = path.read_text().splitlines()[:6]
    assert all(line.startswith("#") for line in header), "recipes open with a comment header"
    assert any("Hardware" in line for line in path.read_text().splitlines()[:20])


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_size_images_for_their_model(path: Path):
    # One visual token per 28x28 pixels on Qwen2.5-VL, 32x32 on Qwen3-VL; LLaMA-Factory runs the
    # model's processor with its own defaults, so no image may be smaller than the processor's
    # minimum (Qwen2.5-VL 3136 pixels, Qwen3-VL 65536), in SFT or in the agent's context.
    recipe = load_recipe(path)
    qwen3 = recipe.model.tiny is None and "Qwen3-VL" in recipe.model.base
    assert recipe.agent.image_factor == (32 if qwen3 else 28)
    assert recipe.sft.template == ("qwen3_vl_nothink" if qwen3 else "qwen2_vl")
    assert recipe.sft.image_min_pixels == recipe.agent.image_min_pixels >= (65536 if qwen3 else 3136)


def test_shipped_recipe_set():
    names = {p.stem for p in RECIPES_DIR.glob("*.yaml")}
    assert {"tiny-cpu", "pyvision-image-7b", "pyvision-video-7b", "pyvision-image-qwen3-8b"} <= names


def test_default_recipe_is_tiny_cpu():
    assert load_recipe().name == "tiny-cpu"


def test_overrides_are_typed_and_nested(tmp_path):
    recipe = load_recipe(None, ["rl.learning_rate=3e-6", "eval.benchmarks=[vstar,hrbench4k]",
                                "rl.strategy.rank_by_std=false", "reward.tool_reward_cap=null"])
    assert recipe.rl.learning_rate == pytest.approx(3e-6)
    assert recipe.eval.benchmarks == ["vstar", "hrbench4k"]
    assert recipe.rl.strategy.rank_by_std is False
    assert recipe.reward.tool_reward_cap is None


def test_unknown_key_names_key_and_closest(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nrl:\n  lerning_rate: 1.0e-6\n")
    with pytest.raises(ConfigError) as exc:
        load_recipe(bad)
    msg = str(exc.value)
    assert "rl.lerning_rate" in msg and "rl.learning_rate" in msg and str(bad) in msg
    # The one-line form keeps the question a question: "...'rl.learning_rate'? Fix: ...".
    assert "'rl.learning_rate'? Fix: rename or remove the key." in exc.value.one_line()


def test_unknown_key_from_set_override():
    with pytest.raises(ConfigError, match=r"'agent\.max_turn'.*'agent\.max_turns_(train|eval)'"):
        load_recipe(None, ["agent.max_turn=3"])


def test_a_moved_key_names_where_it_went():
    # Validation tasks are shared by both RL engines now; verl's old key says so, not a near name.
    with pytest.raises(ConfigError, match=r"'rl\.verl\.val_tasks'.*moved to 'rl\.val_tasks'"):
        load_recipe(None, ["rl.verl.val_tasks=[data/vstar]"])
    assert load_recipe(None, ["rl.val_tasks=[data/vstar]"]).rl.val_tasks == ["data/vstar"]
    # The optimizer's weight decay and clip are both engines' now, not the local engine's.
    for old, new in (("rl.local.weight_decay", "rl.optimizer.weight_decay"),
                     ("rl.local.grad_clip", "rl.optimizer.grad_clip")):
        with pytest.raises(ConfigError, match=rf"'{old}'.*moved to '{new}'"):
            load_recipe(None, [f"{old}=0.1"])
        assert load_recipe(None, [f"{new}=0.1"]).rl.optimizer.model_dump()[new.split(".")[-1]] == 0.1


def test_a_value_no_union_member_takes_is_one_error_at_its_own_key():
    # pydantic fails it once per member, located `args.x.bool`, `args.x.int`, ...: the message
    # names the key the user wrote and what each member wanted, and the hint a key that exists.
    with pytest.raises(ConfigError) as e:
        load_recipe(None, ["rl.optimizer.args={x: [1]}"])
    line = e.value.one_line()
    assert "invalid value for 'rl.optimizer.args.x' " in line and "(and" not in line
    assert "a valid boolean, a valid integer, a valid number or a valid string" in line
    assert "--set rl.optimizer.args.x=VALUE" in line
    # Two keys of one section that are both wrong stay two errors, the first one named.
    with pytest.raises(ConfigError, match=r"'rl\.n'.*greater than or equal to 2 \(and 1 more\)"):
        load_recipe(None, ["rl.n=1", "rl.learning_rate=-1"])


def test_out_of_bounds_value_is_located():
    with pytest.raises(ConfigError, match=r"'rl\.n'.*greater than or equal to 2"):
        load_recipe(None, ["rl.n=1"])


@pytest.mark.parametrize("item", ["agent.max_turns_eval=true", "agent.max_turns_eval=yes",
                                  "agent.temperature=false", "agent.code_temperature=true",
                                  "model.pretrain.mixture={copy: true}"])
def test_a_boolean_is_not_a_number(item):
    # Lax mode read `true` as 1 (and 1.0): max_turns_eval=true was one turn, without a word.
    key = item.split("=")[0]
    with pytest.raises(ConfigError, match=rf"invalid value for '{re.escape(key)}'.*got a boolean") as info:
        load_recipe(None, [item])
    assert "\n" not in info.value.one_line()


def test_a_boolean_is_not_a_number_in_a_yaml_file(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nagent:\n  max_turns_eval: true\n")
    with pytest.raises(ConfigError, match=r"'agent\.max_turns_eval' in .*r\.yaml.*valid integer"):
        load_recipe(bad)


def test_numbers_still_read_as_before(tmp_path):
    # An int for a float, a numeric string, a fraction refused for an int, booleans for booleans.
    good = tmp_path / "r.yaml"
    good.write_text("name: x\nrl:\n  learning_rate: 1\nsft:\n  learning_rate: 1.0e-3\n"
                    "  extra: {flag: true, n: 2}\nagent:\n  max_turns_eval: '7'\n")
    recipe = load_recipe(good, ["agent.temperature=1", "agent.max_turns_train=3",
                                "rl.strategy.rank_by_std=false", "agent.image_factor=32",
                                "agent.on_error=terminate"])
    assert recipe.rl.learning_rate == 1.0 and isinstance(recipe.rl.learning_rate, float)
    assert recipe.sft.learning_rate == pytest.approx(1e-3)
    assert recipe.sft.extra == {"flag": True, "n": 2}
    assert recipe.agent.max_turns_eval == 7 and recipe.agent.max_turns_train == 3
    assert recipe.agent.temperature == 1.0 and recipe.rl.strategy.rank_by_std is False
    with pytest.raises(ConfigError, match=r"'agent\.max_turns_eval'.*fractional part"):
        load_recipe(None, ["agent.max_turns_eval=2.5"])


def test_cross_field_check():
    with pytest.raises(ConfigError, match="mini_batch_prompts"):
        load_recipe(None, ["rl.prompts_per_step=4", "rl.mini_batch_prompts=8"])


def test_bad_set_syntax():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_recipe(None, ["rl.n"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_config_is_frozen():
    recipe = load_recipe()
    with pytest.raises(ValidationError, match="frozen"):
        recipe.rl.n = 3  # type: ignore[misc]


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*bad.yaml:\d"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="recipe not found") as info:
        load_recipe(tmp_path / "nope.yaml")
    assert "tiny-cpu" in info.value.hint  # the shipped recipes' names
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Recipe, listy)


def test_a_shipped_recipe_loads_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_file = load_recipe(RECIPES_DIR / "pyvision-video-7b.yaml", ["seed=3"])
    assert load_recipe("pyvision-video-7b", ["seed=3"]) == by_file
    assert load_recipe("pyvision-video-7b.yaml", ["seed=3"]) == by_file
    assert load_recipe("tiny-cpu") == load_recipe()
    (tmp_path / "tiny-cpu").write_text("name: mine\n")  # a file of that name comes first
    assert load_recipe("tiny-cpu").name == "mine"
    with pytest.raises(ConfigError, match="recipe not found: sub/tiny-cpu"):
        load_recipe("sub/tiny-cpu")  # a path is a path, never a shipped name
