"""Cold-start SFT trajectories: solver code executed in the real sandbox, through the real loop.

For each task, :mod:`pipelines.data.solvers` writes the code a good agent would write. A scripted
policy feeds those turns to the one agent loop, which runs them in the sandbox exactly as it would
run a model's code; the final turn copies the answer from the last line the code actually printed
(never from the gold answer). The result is a trajectory in the PyVision protocol with the real
interpreter outputs, images included. Trajectories whose answer the task's verifier rejects are
dropped and counted, as are those whose code failed.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.protocol import CODE_STOP
from pipelines.config.agent import AgentConfig
from pipelines.config.sandbox import SandboxConfig
from pipelines.core.records import Conversation, read_tasks, write_conversations
from pipelines.data.solvers import SolverPlan, plan, render_turn
from pipelines.fsutil import atomic_dir, atomic_write_json


def last_printed_line(observation_text: str) -> str | None:
    """The last non-empty line of an interpreter turn's text result."""
    body = observation_text.split("Text Result:\n", 1)[-1]
    body = body.split("\nImage Result:", 1)[0].split("</interpreter>", 1)[0]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and ln.strip() != "None"]
    return lines[-1] if lines else None


class SolverPolicy:
    """Replays solver plans. ``begin`` is called once per episode in item order (the loop's
    contract), so plans are consumed in the same order as the tasks were given."""

    name = "solver"

    def __init__(self, plans: Iterator[SolverPlan]) -> None:
        self._plans = plans

    def begin(self, messages: list[dict]) -> dict[str, Any]:
        return {"plan": next(self._plans), "turn": 0, "last_obs": "", "gen": 0, "obs": 0,
                "prompt": sum(len(p.get("text", "").split()) for p in messages[0]["content"])}

    def generate(self, handles: list[dict], sampling: Sampling) -> list[Generation]:
        out = []
        for h in handles:
            steps = h["plan"].steps
            if h["turn"] < len(steps):
                text = render_turn(steps[h["turn"]])
                finish = "code"
            else:
                value = last_printed_line(h["last_obs"]) or h["plan"].answer
                closing = h["plan"].final_thought.replace(h["plan"].answer, value)
                text = f"{closing}\n<answer>\n\\boxed{{{value}}}\n</answer>"
                finish = "eos"
            h["turn"] += 1
            n = len(text.split())
            h["gen"] += n
            out.append(Generation(text=text if finish != "code" else text[: text.rfind(CODE_STOP) + len(CODE_STOP)],
                                  finish=finish, n_tokens=n))
        return out

    def observe(self, handle: dict, parts: list[dict], images: list[Any]) -> None:
        handle["last_obs"] = "".join(p.get("text", "") for p in parts)
        handle["obs"] += len(handle["last_obs"].split())

    def context_tokens(self, handle: dict) -> int:
        return handle["prompt"] + handle["gen"] + handle["obs"]

    def token_counts(self, handle: dict) -> dict[str, int]:
        return {"prompt": handle["prompt"], "generated": handle["gen"],
                "observation": handle["obs"], "visual": 0}

    def trace(self, handle: dict) -> None:
        return None

    def end(self, handle: dict) -> None:
        handle.clear()


def make_trajectories(tasks_dir: str | Path, out: str | Path, *, seed: int = 0,
                      agent_cfg: AgentConfig | None = None, sandbox_cfg: SandboxConfig | None = None,
                      limit: int | None = None, batch_size: int = 8, force: bool = False,
                      progress: bool = True) -> dict[str, Any]:
    """Write ``out/conversations.jsonl`` + ``out/media`` from the tasks in ``tasks_dir``."""
    from benchmarks.scoring import verify
    from pipelines.agent.loop import run_episodes
    from pipelines.errors import UserError

    agent = (agent_cfg or AgentConfig()).model_copy(update={"max_turns_train": 8, "max_turns_eval": 8})
    # Strict: a malformed or invalid line is an error naming the file and line, not a task
    # silently missing from the cold-start data.
    tasks, _ = read_tasks(tasks_dir, strict=True)
    tasks = tasks[:limit] if limit else tasks
    root = Path(tasks_dir) if Path(tasks_dir).is_dir() else Path(tasks_dir).parent
    out = Path(out)
    if (out / "manifest.json").exists() and not force:
        raise UserError(f"{out} already holds finished trajectories",
                        hint="pass --force to regenerate them, or another --out")
    if out.is_dir():  # anything else there would be replaced only at the end: refused now
        from pipelines.core.modeldir import refuse_existing

        refuse_existing(out, force)
    plans = [plan(t, random.Random(f"{seed}:{t.id}")) for t in tasks]
    start = time.monotonic()
    dropped: Counter[str] = Counter()
    kept: list[Conversation] = []
    per_family: Counter[str] = Counter()
    from pipelines.data.synth import _progress

    tracker = _progress(progress, "trajectories", len(tasks))
    by_id = {t.id: t for t in tasks}
    with atomic_dir(out, overwrite=force) as tmp:
        done = 0
        for traj in run_episodes([(t, root) for t in tasks], SolverPolicy(iter(plans)), agent,
                                 sandbox_cfg, mode="eval", batch_size=batch_size):
            done += 1
            tracker(done)
            task = by_id[traj.task_id]
            if traj.failed_calls:
                dropped["code_error"] += 1
                continue
            if traj.stop_reason != "answered":
                dropped[f"stop:{traj.stop_reason}"] += 1
                continue
            if not verify(task, traj.final_answer).correct:
                dropped["wrong_answer"] += 1
                continue
            kept.append(traj.to_conversation(f"traj-{task.id}", tmp / "media", "media/"))
            per_family[task.metadata.get("family", "other")] += 1
        tracker(None)
        kept.sort(key=lambda c: c.id)
        write_conversations(tmp / "conversations.jsonl", kept)
        seconds = time.monotonic() - start
        manifest = {"tasks": len(tasks), "kept": len(kept), "dropped": dict(dropped),
                    "per_family": dict(per_family), "seconds": round(seconds, 2),
                    "trajectories_per_s": round(len(tasks) / max(seconds, 1e-9), 2),
                    "source": str(tasks_dir)}
        atomic_write_json(tmp / "manifest.json", manifest)
    return manifest
