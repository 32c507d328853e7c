"""verl's ``custom_reward_function``: the PyVision reward, term by term.

verl's reward workers call :func:`compute_score` with the run's recipe as a reward kwarg; the
reward is the local engine's (:func:`pipelines.scoring.reward.compute_reward`). What verl passes
in, the fallback when the loop's fields are missing, and why the judge cache is per worker:
docs/verl-integration.md ("reward.py").
"""

from __future__ import annotations

import os
import re
import threading
from functools import lru_cache
from typing import Any

from pipelines.agent.protocol import extract_answer
from pipelines.config.reward import RewardConfig
from pipelines.core.records import Task
from pipelines.errors import DataError, UserError
from pipelines.scoring.reward import compute_reward

RECIPE_ENV = "PYVISION_VERL_RECIPE"
TERMS = ("score", "accuracy", "tool", "format", "correct", "judged", "judge_fallback",
         "length_guard", "parsed_from_text")
_INTERPRETER_RE = re.compile(r"<interpreter>(.*?)</interpreter>", re.DOTALL)


_SETTINGS_LOCK = threading.Lock()


def _settings(recipe_path: str) -> tuple[RewardConfig, Any]:
    """The run's reward settings and its judge client (one per process, shared by threads:
    verl's reward threads ask together at the start, and each building its own judge would
    multiply the requests in flight past ``reward.judge.concurrency``)."""
    with _SETTINGS_LOCK:
        return _load_settings(recipe_path)


@lru_cache(maxsize=8)
def _load_settings(recipe_path: str) -> tuple[RewardConfig, Any]:
    from pipelines.config.recipe import load_recipe

    reward = load_recipe(recipe_path).reward
    judge = None
    if reward.judge.base_url:
        from pipelines.scoring.judge import Judge

        judge = Judge(reward.judge)
    return reward, judge


def _from_text(solution_str: str) -> tuple[str | None, int, bool, int]:
    """(final answer, its length, well formed, successful calls) parsed from the decoded text."""
    blocks = _INTERPRETER_RE.findall(solution_str)
    model_text = _INTERPRETER_RE.sub("", solution_str)
    answer, raw = extract_answer(model_text)
    successful = sum(1 for b in blocks if "\nError (" not in b)
    return answer, len(raw or ""), answer is not None, successful


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None, *, recipe: str | None = None,
                  **_: Any) -> dict[str, float]:
    """The reward of one trajectory and its terms (docs/verl-integration.md, "reward.py")."""
    extra = dict(extra_info or {})
    recipe = recipe or os.environ.get(RECIPE_ENV)
    if not recipe:
        raise UserError("the PyVision reward was called without the run's recipe",
                        hint="set reward.custom_reward_function.reward_kwargs.recipe to "
                             "<run>/rl/config.yaml (`pyvision rl --engine verl` does)")
    raw_task = extra.get("task")
    if not raw_task:
        raise DataError(f"reward for a '{data_source}' row without extra_info.task "
                        f"(index {extra.get('index', '?')})",
                        hint="export the RL data with `pyvision data export --format verl`")
    task = Task.model_validate_json(raw_task)
    cfg, judge = _settings(str(recipe))
    if "final_answer" in extra and "well_formed" in extra:
        answer = extra["final_answer"] or None
        well_formed = bool(extra["well_formed"])
        chars = int(extra.get("answer_chars") or len(answer or ""))
        successful = int(extra.get("successful_calls") or 0)
        parsed = 0.0
    else:
        answer, chars, well_formed, successful = _from_text(solution_str)
        parsed = 1.0
    r = compute_reward(task, answer, answer_chars=chars, successful_tool_calls=successful,
                       well_formed=well_formed, cfg=cfg, judge=judge)
    return {"score": float(r.total), "accuracy": float(r.accuracy), "tool": float(r.tool),
            "format": float(r.format), "correct": float(r.correct), "judged": float(r.judged),
            "judge_fallback": float(r.judge_fallback),
            "length_guard": float(r.scorer == "length-guard"), "parsed_from_text": parsed}
