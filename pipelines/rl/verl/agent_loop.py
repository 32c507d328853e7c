"""PyVision's agent loop inside verl 0.9.1: the one loop of ``pipelines.agent.loop``, sampled by verl.

verl instantiates :class:`PyVisionAgentLoop` once per trajectory from the agent-loop YAML the
launcher writes. How the loop runs beside verl's event loop, its token and image bookkeeping, its
limits and the fields it hands the reward and the ranking: docs/verl-integration.md
("agent_loop.py").
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any
from uuid import uuid4

from pydantic import ValidationError
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.rollout_trace import rollout_trace_op

from pipelines.agent.loop import run_episodes
from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.tokens import ChatTokens, TokenContext
from pipelines.agent.protocol import CODE_STOP
from pipelines.agent.trajectory import TRUNCATED_STOPS, Trajectory
from pipelines.config.recipe import Recipe, load_recipe
from pipelines.core.records import Task
from pipelines.errors import DataError, UserError
from pipelines.rl.verl.overrides import CODE_TEMPERATURE_UNSUPPORTED

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")
# Trajectories block a thread each while they wait for the server; an AgentLoopWorker runs a
# few hundred at a time at most, and a waiting thread costs little. Beyond this they queue.
EPISODE_THREADS = 512

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _episode_pool() -> ThreadPoolExecutor:
    # Not the event loop's default executor: verl's own run_in_executor calls (token builder,
    # reward) must not queue behind trajectories that wait for generations.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=EPISODE_THREADS,
                                       thread_name_prefix="pyvision-episode")
        return _pool


def _load(recipe: str | None) -> Recipe:
    # verl builds one loop object per trajectory: parse the recipe once per file version.
    if recipe is None:
        return _load_version(None, 0, 0)
    try:
        st = os.stat(recipe)
    except OSError:
        raise UserError(f"recipe of the PyVision agent loop not found: {recipe}",
                        hint="point `recipe:` in the agent-loop YAML at the run's rl/config.yaml"
                        ) from None
    return _load_version(recipe, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _load_version(recipe: str | None, mtime_ns: int, size: int) -> Recipe:
    return load_recipe(recipe)


class ServerPolicy:
    """A policy whose model is verl's ``server_manager``; one instance per trajectory."""

    name = "verl"

    def __init__(self, tokens: ChatTokens, server_manager: Any, loop: asyncio.AbstractEventLoop,
                 *, request_id: str, sampling_params: dict[str, Any], response_budget: int,
                 max_context_tokens: int, prompt_limit: int, task_id: str = "?",
                 priority: int = 0) -> None:
        self.tokens = tokens
        self.server_manager = server_manager
        self.loop = loop
        self.request_id = request_id
        self.sampling_params = dict(sampling_params)
        self.response_budget = response_budget
        self.max_context_tokens = max_context_tokens
        self.prompt_limit = prompt_limit
        self.task_id = task_id
        self.priority = priority
        self.vision_ids = {i for i in tokens.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
                           if i is not None and i != tokens.tokenizer.unk_token_id}
        self.slack = 0
        # Log-probs were asked for and every turn came with them (verl batches all-or-none).
        self.has_logprobs = bool(self.sampling_params.get("logprobs"))
        self.generate_s = 0.0
        self.num_preempted: int | None = None
        self.server_fields: dict[str, Any] = {}

    def begin(self, messages: list[dict]) -> TokenContext:
        # A prompt over rollout.prompt_length is the loop's to stop (prompt_too_long): verl pads
        # prompts to that length and cannot cut a multimodal one.
        ctx = self.tokens.begin(messages)
        # Context reported to the loop = real context + slack, so that reaching
        # agent.max_context_tokens there means: either the real context or the response is full.
        self.slack = max(0, self.max_context_tokens - (ctx.prompt_len + self.response_budget))
        return ctx

    def observe(self, handle: TokenContext, parts: list[dict], images: list[Any]) -> None:
        self.tokens.observe(handle, parts, images)

    def context_tokens(self, handle: TokenContext) -> int:
        return len(handle.ids) + self.slack

    def token_counts(self, handle: TokenContext) -> dict[str, int]:
        return self.tokens.token_counts(handle)

    def trace(self, handle: TokenContext) -> Any:
        return self.tokens.trace(handle)

    def end(self, handle: TokenContext) -> None:
        self.tokens.end(handle)

    def generate(self, handles: list[TokenContext], sampling: Sampling) -> list[Generation]:
        # Called from the episode thread; the request itself runs on verl's event loop.
        return [asyncio.run_coroutine_threadsafe(self._generate(h, sampling), self.loop).result()
                for h in handles]

    async def _generate(self, ctx: TokenContext, sampling: Sampling) -> Generation:
        # verl decides how to sample (rollout temperature, greedy validation); the loop decides
        # how many tokens this turn may use.
        params = {**self.sampling_params, "max_tokens": sampling.max_new_tokens,
                  "stop": [CODE_STOP], "include_stop_str_in_output": True}
        t0 = self.loop.time()
        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=list(ctx.ids), sampling_params=params,
            image_data=list(ctx.images) or None, video_data=None,
            mm_processor_kwargs=self.tokens.processor_kwargs if ctx.images else None,
            priority=self.priority)
        self.generate_s += self.loop.time() - t0
        self._record(out)
        row = list(out.token_ids)
        logprobs = list(out.log_probs) if out.log_probs else None
        if row and logprobs is None:
            self.has_logprobs = False
        bad = next((i for i, t in enumerate(row) if t in self.vision_ids), None)
        if bad is not None:
            row = row[:bad]
        kept, finish, text = self.tokens.cut(row)
        if bad is not None and len(kept) == len(row):
            finish = "length"
        lp = logprobs[: len(kept)] if logprobs is not None else [0.0] * len(kept)
        self.tokens.append_generated(ctx, kept, lp)
        return Generation(text=text, finish=finish, n_tokens=len(kept))

    def _record(self, out: Any) -> None:
        if out.num_preempted is not None:
            self.num_preempted = (self.num_preempted or 0) + int(out.num_preempted)
        fields = dict(out.extra_fields or {})
        if not self.server_fields:
            self.server_fields = fields
        elif fields.get("max_global_steps") is not None:
            # The weights may change between turns (partial rollouts): keep the newest version.
            self.server_fields["max_global_steps"] = fields["max_global_steps"]


def fit_response(prompt_ids: list[int], response_ids: list[int], mask: list[int],
                 logprobs: list[float] | None, images: list[Any], budget: int,
                 vision_start: int, vision_end: int, image_pad: int
                 ) -> tuple[list[int], list[int], list[float] | None, list[Any]]:
    """Cut a response to at most ``budget`` tokens at a turn boundary (where the mask changes:
    a model turn begins or ends), so no turn is split and no image's
    ``<|vision_start|>...<|vision_end|>`` span either; keep the images whose pad runs remain
    (image i is the i-th pad run of prompt + response)."""
    if len(response_ids) <= budget:
        return response_ids, mask, logprobs, images
    boundaries = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    cut = max((b for b in boundaries if b <= budget), default=0)
    if cut == 0:
        # No boundary fits (one turn longer than the budget, which the loop's token limits
        # prevent): cut at the budget, before any image span it would split.
        cut = budget
        start = next((i for i in range(cut - 1, -1, -1) if response_ids[i] == vision_start),
                     None)
        if start is not None:
            end = next((i for i in range(start, len(response_ids))
                        if response_ids[i] == vision_end), len(response_ids))
            if end >= cut:
                cut = start
    kept = response_ids[:cut]
    n_images = _pad_runs(prompt_ids + kept, image_pad)
    return kept, mask[:cut], (logprobs[:cut] if logprobs is not None else None), images[:n_images]


def _pad_runs(ids: list[int], pad: int) -> int:
    return sum(1 for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad))


class PyVisionAgentLoop(AgentLoopBase):
    """verl's agent-loop interface around :func:`pipelines.agent.loop.run_episodes`."""

    def __init__(self, *args: Any, recipe: str | None = None, **kwargs: Any) -> None:
        # ``name`` (from the YAML entry) and ``tools`` (verl's tool list) arrive in kwargs; the
        # sandbox is our only tool, so both are ignored.
        kwargs.pop("name", None)
        kwargs.pop("tools", None)
        super().__init__(*args, **kwargs)
        self.recipe = _load(str(recipe) if recipe is not None else None)
        if self.recipe.agent.code_temperature is not None:
            raise UserError(CODE_TEMPERATURE_UNSUPPORTED,
                            hint="unset agent.code_temperature, or train with --engine local")
        if self.processor is None or getattr(self.processor, "image_processor", None) is None:
            raise UserError("the PyVision agent loop needs a vision-language model with a "
                            "processor, but verl loaded none",
                            hint="set actor_rollout_ref.model.path to a Qwen2.5-VL checkpoint")
        self.response_length = int(self.rollout_config.response_length)
        self.prompt_length = int(self.rollout_config.prompt_length)

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], priority: int = 0,
                  **kwargs: Any) -> AgentLoopOutput:
        priority = int(priority)
        task, root = self._task(kwargs)
        agent = self.recipe.agent
        budget = min(self.recipe.rl.max_response_tokens, self.response_length)
        tokens = ChatTokens(self.processor, image_min_pixels=agent.image_min_pixels,
                            image_max_pixels=agent.image_max_pixels, keep_pixels=False,
                            image_factor=agent.image_factor)
        full_determinism = bool(self.rollout_config.get("full_determinism", False))
        policy = ServerPolicy(
            tokens, self.server_manager, asyncio.get_running_loop(),
            request_id=f"det-{priority}" if full_determinism else uuid4().hex,
            sampling_params=sampling_params, response_budget=budget,
            max_context_tokens=agent.max_context_tokens, prompt_limit=self.prompt_length,
            task_id=task.id, priority=priority)
        sampling = Sampling(agent.max_new_tokens_per_turn,
                            float(sampling_params.get("temperature", agent.temperature)),
                            float(sampling_params.get("top_p", agent.top_p)))
        traj = await asyncio.get_running_loop().run_in_executor(
            _episode_pool(), self._episode, task, root, policy, sampling)
        return self._output(traj, policy, tokens, budget)

    def _task(self, kwargs: dict[str, Any]) -> tuple[Task, Path]:
        extra = kwargs.get("extra_info") or {}
        raw, root = extra.get("task"), extra.get("media_root")
        where = f"verl row index {extra.get('index', kwargs.get('index', '?'))}"
        if not raw:
            raise DataError(f"{where} has no extra_info.task",
                            hint="export the RL data with `pyvision data export --format verl`")
        try:
            task = Task.model_validate_json(raw)
        except ValidationError as exc:
            raise DataError(f"{where}: extra_info.task is not a valid task "
                            f"({exc.errors()[0]['msg']})",
                            hint="re-export the RL data with this version of pyvision") from None
        relative = [p for p in [*task.images, task.video] if p and not Path(p).is_absolute()]
        if relative and not root:
            raise DataError(f"{where}: task {task.id} has relative media paths but no "
                            "extra_info.media_root", hint="re-export the RL data")
        return task, Path(root or ".")

    def _episode(self, task: Task, root: Path, policy: ServerPolicy,
                 sampling: Sampling) -> Trajectory:
        (traj,) = run_episodes([(task, root)], policy, self.recipe.agent, self.recipe.sandbox,
                               mode="train", batch_size=1, sampling=sampling,
                               max_prompt_tokens=policy.prompt_limit)
        return traj

    def _output(self, traj: Trajectory, policy: ServerPolicy, tokens: ChatTokens,
                budget: int) -> AgentLoopOutput:
        trace = traj.trace
        assert trace is not None  # ChatTokens always keeps the trace
        if traj.stop_reason == "prompt_too_long":
            return self._dropped_prompt(traj, policy, tokens)
        prompt_ids = trace.input_ids[: trace.prompt_len]
        response_ids = trace.input_ids[trace.prompt_len:]
        logprobs = _aligned_logprobs(trace.response_mask, trace.logprobs) \
            if policy.has_logprobs else None
        vision_start, vision_end = tokens.tokenizer.convert_tokens_to_ids(
            ["<|vision_start|>", "<|vision_end|>"])
        response_ids, mask, logprobs, images = fit_response(
            prompt_ids, response_ids, trace.response_mask, logprobs, trace.images, budget,
            vision_start, vision_end, tokens.image_token_id)
        masked = self.recipe.rl.mask_truncated and traj.stop_reason in TRUNCATED_STOPS
        if masked:
            mask = [0] * len(mask)
        observations = sum(1 for t in traj.turns if t.observation is not None)
        metrics: dict[str, Any] = {"generate_sequences": policy.generate_s,
                                   "tool_calls": traj.tool_s}
        if policy.num_preempted is not None:
            metrics["num_preempted"] = policy.num_preempted
        extra = {k: v for k, v in policy.server_fields.items()
                 if k in ("global_steps", "min_global_steps", "max_global_steps")}
        extra.update({
            "tool_calls": traj.tool_calls,
            "successful_calls": traj.successful_calls,
            "failed_calls": traj.failed_calls,
            "num_turns": traj.num_turns,
            "assistant_turns": traj.num_turns,
            "stop_reason": traj.stop_reason or "",
            "final_answer": traj.final_answer or "",
            "answer_chars": traj.answer_chars,
            "produced_image": traj.produced_image,
            "well_formed": traj.stop_reason == "answered",
            "context_images": len(images),
            "visual_tokens": traj.visual_tokens,
            "response_truncated": len(response_ids) < len(trace.response_mask),
            "masked": masked,
            "prompt_tokens": traj.prompt_tokens,
            "prompt_version": traj.prompt_version,
            "turn_scores": [],
            "tool_rewards": [],
        })
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask,
            response_logprobs=logprobs,
            multi_modal_data={"images": images} if images else {},
            mm_processor_kwargs=tokens.processor_kwargs if images else None,
            num_turns=1 + traj.num_turns + observations, metrics=metrics, extra_fields=extra)


    def _dropped_prompt(self, traj: Trajectory, policy: ServerPolicy,
                        tokens: ChatTokens) -> AgentLoopOutput:
        """A stand-in for a trajectory whose prompt does not fit ``rollout.prompt_length``: a
        short text-only prompt and one environment token (no loss), so verl can pad and batch it;
        ``stop_reason`` says what happened and the ranking sampler drops it."""
        text = tokens.processor.apply_chat_template(
            [{"role": "user", "content": "[prompt too long]"}], add_generation_prompt=True,
            tokenize=False)
        # Text only, so cutting it to fit is harmless; nothing is trained on it.
        prompt_ids = tokens.tokenizer.encode(text, add_special_tokens=False)[-policy.prompt_limit:]
        extra = {"tool_calls": 0, "successful_calls": 0, "failed_calls": 0, "num_turns": 0,
                 "assistant_turns": 0, "stop_reason": "prompt_too_long", "final_answer": "",
                 "answer_chars": 0, "produced_image": False, "well_formed": False,
                 "context_images": 0, "visual_tokens": traj.visual_tokens,
                 "response_truncated": False, "masked": True, "prompt_tokens": traj.prompt_tokens,
                 "prompt_version": traj.prompt_version, "turn_scores": [], "tool_rewards": []}
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=[tokens.im_end], response_mask=[0],
            response_logprobs=[0.0] if policy.has_logprobs else None, multi_modal_data={},
            num_turns=1, metrics={"generate_sequences": 0.0, "tool_calls": 0.0},
            extra_fields=extra)


def _aligned_logprobs(mask: list[int], model_logprobs: list[float]) -> list[float]:
    """verl wants one log-prob per response token (0 on environment tokens)."""
    it = iter(model_logprobs)
    return [next(it) if m else 0.0 for m in mask]
