"""The one agent loop, shared by RL rollouts and evaluation.

``run_episodes`` keeps up to ``batch_size`` episodes active. Each iteration asks the policy for
the next turn of every active episode in one call (a batched forward for in-process models,
concurrent requests for servers), runs the code of those that wrote code in their own sandboxes
concurrently, appends the interpreter turns, and retires finished episodes, refilling their slots
from the queue (continuous batching). Finished trajectories are yielded as soon as they finish,
so evaluation can store each one immediately and resume after an interruption.

The loop is deterministic for a deterministic policy: the next generation call starts only after
every sandbox call of the iteration has returned, so scheduling never depends on timing. A policy
that reports each turn as it ends (``on_done``, the in-process policy) lets an episode's code start
in the sandbox while the rest of the batch is still generating; what the code returns is the same,
only sooner.

Stop reasons (every trajectory has exactly one): ``answered``, ``max_turns``,
``context_overflow`` (the context reached the token limit), ``image_limit`` (showing more images
would exceed ``max_images``), ``no_code_nor_answer`` (malformed: a turn with neither code nor an
answer), ``tool_error`` (a failed call with ``on_error: terminate``), ``prompt_too_long`` (the
first turn alone exceeds ``max_prompt_tokens``: the episode never generates, and RL drops it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipelines.agent.policies.base import Policy, Sampling
from pipelines.agent.prompts import build_initial_messages, resize_for_context, variant_for
from pipelines.agent.protocol import format_observation, parse_turn
from pipelines.agent.trajectory import ToolResult, Trajectory, Turn
from pipelines.config.agent import AgentConfig
from pipelines.config.sandbox import SandboxConfig
from pipelines.core.records import Task


@dataclass
class Episode:
    item: int
    sample: int
    task: Task
    traj: Trajectory
    handle: Any
    runtime_media: dict[str, dict[str, Path]]
    sandbox: Any = None
    sandbox_ready: Any = None  # Future of the sandbox, started with the episode
    images_in_context: int = 0
    start: float = field(default_factory=time.monotonic)
    pending_code: str | None = None


def run_episodes(items: Iterable[tuple[Task, Path]], policy: Policy, agent_cfg: AgentConfig,
                 sandbox_cfg: SandboxConfig | None = None, *,
                 mode: Literal["train", "eval"] = "eval", batch_size: int = 8,
                 n_per_item: int = 1, variant: str | None = None,
                 sampling: Sampling | None = None,
                 max_prompt_tokens: int | None = None) -> Iterator[Trajectory]:
    """Run every (task, media root) ``n_per_item`` times; yield trajectories as they finish.

    ``max_prompt_tokens``: an episode whose first turn (image tokens included) is longer stops
    at once with ``prompt_too_long`` instead of failing the batch."""
    from pipelines.agent.sandbox import Sandbox

    sandbox_cfg = sandbox_cfg or SandboxConfig()
    max_turns = agent_cfg.max_turns_train if mode == "train" else agent_cfg.max_turns_eval
    if sampling is None:
        temperature = agent_cfg.temperature if mode == "train" else agent_cfg.eval_temperature
        sampling = Sampling(agent_cfg.max_new_tokens_per_turn, temperature, agent_cfg.top_p,
                            agent_cfg.code_temperature if mode == "train" else None)
    queue: deque[tuple[int, int, Task, Path]] = deque(
        (i, s, task, Path(root)) for i, (task, root) in enumerate(items) for s in range(n_per_item))
    active: list[Episode] = []
    done: list[Trajectory] = []
    pool = ThreadPoolExecutor(max_workers=max(1, batch_size), thread_name_prefix="sandbox")

    def finish(ep: Episode, reason: str) -> None:
        t = ep.traj
        t.stop_reason = reason  # type: ignore[assignment]
        counts = policy.token_counts(ep.handle)
        t.prompt_tokens, t.generated_tokens = counts["prompt"], counts["generated"]
        t.observation_tokens, t.visual_tokens = counts["observation"], counts["visual"]
        t.trace = policy.trace(ep.handle)
        usage = getattr(policy, "request_usage", None)
        if usage is not None:
            t.request_usage = usage(ep.handle)
        t.total_s = time.monotonic() - ep.start
        policy.end(ep.handle)
        close_sandbox(ep)
        done.append(t)

    prepared: dict[int, Future] = {}

    def prepare(item: int, task: Task, root: Path) -> Future:
        """A task's first turn (its images decoded and resized), built once for all its samples
        and on a pool thread, ahead of the episode that needs it."""
        if item not in prepared:
            prepared[item] = pool.submit(build_initial_messages, task, root,
                                         variant_for(task, agent_cfg, variant), agent_cfg)
        return prepared[item]

    def prefetch() -> None:
        for item, _, task, root in itertools.islice(queue, batch_size):
            prepare(item, task, root)

    def start(item: int, sample: int, task: Task, root: Path) -> Episode:
        messages, info, runtime = prepare(item, task, root).result()
        if sample == n_per_item - 1:
            prepared.pop(item, None)
        # Each sample its own turn list (policies append to it); the images are shared, read-only.
        messages = [{**m, "content": [dict(p) for p in m["content"]]} for m in messages]
        traj = Trajectory(task_id=task.id, data_source=task.data_source, variant=info.variant,
                          prompt_version=info.version, prompt_hash=info.sha256, mode=mode,
                          sample_index=sample, group_index=item)
        prompt_parts = []
        for p in messages[0]["content"]:
            if p.get("type") == "image":
                traj.images.append(p["image"])
                prompt_parts.append({"type": "image", "index": len(traj.images) - 1})
            else:
                prompt_parts.append(dict(p))
        traj.prompt = prompt_parts
        handle = policy.begin(messages)
        return Episode(item, sample, task, traj, handle, runtime,
                       images_in_context=len(traj.images))

    def new_sandbox(ep: Episode) -> Any:
        return Sandbox(sandbox_cfg, images=ep.runtime_media["images"],
                       videos=ep.runtime_media["videos"],
                       context_pixels=(agent_cfg.image_min_pixels, agent_cfg.image_max_pixels),
                       context_factor=agent_cfg.image_factor)

    def run_code(ep: Episode) -> Any:
        if ep.sandbox is None:  # a failed start raises here, as a lazy one would
            ep.sandbox = (ep.sandbox_ready.result() if ep.sandbox_ready is not None
                          else new_sandbox(ep))
        return ep.sandbox.run(ep.pending_code or "")

    def close_sandbox(ep: Episode) -> None:
        if ep.sandbox is None and ep.sandbox_ready is not None and \
                not ep.sandbox_ready.cancel():
            # Never used: a start error is moot, the sandbox (if it started) is closed.
            with contextlib.suppress(Exception):
                ep.sandbox = ep.sandbox_ready.result()
        if ep.sandbox is not None:
            ep.sandbox.close()

    streams = policy is not None and "on_done" in inspect.signature(policy.generate).parameters
    try:
        while queue or active:
            prefetch()
            while queue and len(active) < batch_size:
                ep = start(*queue.popleft())
                if max_prompt_tokens is not None and \
                        policy.token_counts(ep.handle)["prompt"] > max_prompt_tokens:
                    finish(ep, "prompt_too_long")
                elif policy.context_tokens(ep.handle) >= agent_cfg.max_context_tokens:
                    finish(ep, "context_overflow")
                else:
                    active.append(ep)
                    # Fork the sandbox and load its media now, while the model generates,
                    # instead of when the first code block is ready (off the critical path).
                    ep.sandbox_ready = pool.submit(new_sandbox, ep)
            prefetch()  # the next episodes' prompts, while this batch generates
            yield from _drain(done)
            if not active:
                continue
            room = min(agent_cfg.max_context_tokens - policy.context_tokens(e.handle) for e in active)
            step = dataclasses.replace(sampling,
                                       max_new_tokens=max(1, min(sampling.max_new_tokens, room)))
            early: dict[int, Any] = {}

            def started(i: int, gen: Any, batch: list[Episode] = active,
                        early: dict[int, Any] = early) -> None:
                """Run a finished turn's code at once, while the others still generate."""
                parsed = parse_turn(gen.text)
                if parsed.kind == "code":
                    batch[i].pending_code = parsed.code
                    early[i] = pool.submit(run_code, batch[i])

            t0 = time.monotonic()
            gens = (policy.generate([e.handle for e in active], step, on_done=started) if streams
                    else policy.generate([e.handle for e in active], step))
            gen_s = time.monotonic() - t0
            coding: list[Episode] = []
            running: list[Any] = []
            still: list[Episode] = []
            for i, (ep, gen) in enumerate(zip(active, gens)):
                ep.traj.generation_s += gen_s / len(active)
                parsed = parse_turn(gen.text)
                turn = Turn(assistant=gen.text, finish=gen.finish)
                ep.traj.turns.append(turn)
                if parsed.kind == "answer":
                    ep.traj.final_answer, ep.traj.raw_answer = parsed.answer, parsed.raw_answer
                    finish(ep, "answered")
                elif parsed.kind == "code":
                    turn.code = parsed.code
                    ep.pending_code = parsed.code
                    coding.append(ep)
                    running.append(early[i] if i in early else pool.submit(run_code, ep))
                elif policy.context_tokens(ep.handle) >= agent_cfg.max_context_tokens:
                    finish(ep, "context_overflow")
                else:
                    finish(ep, "no_code_nor_answer")
            results = [f.result() for f in running]
            for ep, res in zip(coding, results):
                t = ep.traj
                turn = t.turns[-1]
                t.tool_calls += 1
                t.tool_s += res.duration_s
                ok = res.status == "ok"
                t.successful_calls += int(ok)
                t.failed_calls += int(not ok)
                turn.result = ToolResult(res.status, res.stdout, res.stderr, res.duration_s,
                                         len(res.frames), res.truncated)
                ep.pending_code = None
                if not ok and agent_cfg.on_error == "terminate":
                    finish(ep, "tool_error")
                    continue
                if ep.images_in_context + len(res.frames) > agent_cfg.max_images:
                    finish(ep, "image_limit")
                    continue
                # Already at context size (the sandbox resized them); this is then a no-op.
                images = [resize_for_context(img, agent_cfg.image_min_pixels,
                                             agent_cfg.image_max_pixels, agent_cfg.image_factor)
                          for img in res.frames]
                parts = format_observation(res.status, res.stdout, res.stderr, len(images),
                                           ep.images_in_context + 1, agent_cfg.on_error)
                stored, k = [], 0
                for p in parts:
                    if p.get("type") == "image":
                        t.images.append(images[k])
                        turn.image_indices.append(len(t.images) - 1)
                        stored.append({"type": "image", "index": len(t.images) - 1})
                        k += 1
                    else:
                        stored.append(p)
                turn.observation = stored
                policy.observe(ep.handle, parts, images)
                ep.images_in_context += len(images)
                if policy.context_tokens(ep.handle) >= agent_cfg.max_context_tokens:
                    finish(ep, "context_overflow")
                elif len(t.turns) >= max_turns:
                    finish(ep, "max_turns")
                else:
                    still.append(ep)
            active = still
            yield from _drain(done)
    finally:
        for ep in active:
            policy.end(ep.handle)
            close_sandbox(ep)
        pool.shutdown(wait=False)


def _drain(done: list[Trajectory]) -> Iterator[Trajectory]:
    while done:
        yield done.pop(0)
