"""verl's ``custom_reward_function``: the PyVision reward, term by term.

verl's reward workers import this module (``reward.custom_reward_function.path=
pkg://pipelines.rl.verl.reward``, ``name=compute_score``) and, through the ``naive`` reward
manager, call::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
                  recipe=<run>/rl/config.yaml)

``recipe`` comes from ``reward.custom_reward_function.reward_kwargs`` (verl 0.9.1 merges those
kwargs into every call); the launcher sets it to the run's resolved config, so the reward settings
and the judge endpoint are the run's own. ``extra_info`` is the parquet row's ``extra_info``
(``task``, ``media_root``, ...) into which the naive manager has merged the agent loop's
``extra_fields`` (``final_answer``, ``well_formed``, ``answer_chars``, ``successful_calls``, ...).

The reward is :func:`pipelines.scoring.reward.compute_reward`, the local engine's: accuracy from the
shared verifiers (the benchmarks' scorers), the judge first for the answer types in
``reward.judge.use_for`` when ``reward.judge.base_url`` is set (an unreachable judge falls back to
the rule verifier and is counted), the accumulative tool reward only when correct, and the
answer-length guard on the whole reward. The task (answer type, options, metric) comes from
``extra_info.task``; ``ground_truth`` is its answer and is not used on its own.

When the loop's fields are missing (a row rolled out by another loop), the answer is parsed from
``solution_str`` with the protocol's parser, ignoring ``<interpreter>`` blocks (code output is not
the model's answer), and successful calls are the interpreter turns without an ``Error (``
report; ``parsed_from_text`` records that this happened.

The returned dict has the same float-valued keys for every sample (verl stacks them into
arrays and averages them in its validation metrics); ``score`` is the reward.

The judge's answers are cached in memory per worker process, not in the store: the store is one
DuckDB file that dozens of reward workers on several nodes must not write to.
"""

from __future__ import annotations

import os
import re
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


@lru_cache(maxsize=8)
def _settings(recipe_path: str) -> tuple[RewardConfig, Any]:
    """The run's reward settings and its judge client (one per process, shared by threads)."""
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
    """The reward of one trajectory and its terms (see the module docstring)."""
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
