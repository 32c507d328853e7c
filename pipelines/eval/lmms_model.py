"""The `pyvision_agent` lmms-eval model: each request is one trajectory of our agent loop.

``--model_args pretrained=PATH_OR_URL[,recipe=RECIPE.yaml][,max_turns=N][,engine=hf|openai|vllm]
[,served_model=NAME]`` and lmms-eval's own ``--batch_size N`` (trajectories advanced together).
The recipe (default: the embedded one) supplies the agent and sandbox settings; ``max_turns``
overrides its ``agent.max_turns_eval``.
The request's text becomes the question, its visuals become the task's images (or its video),
and the answer lmms-eval scores is the trajectory's final ``\\boxed{}`` answer (empty when the
agent never answered). Log-likelihood requests are not something an agent can answer and fail with
a clear error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lmms_eval.api.model import lmms

from pipelines.core.media import to_rgb
from pipelines.core.records import Task


class PyVisionAgent(lmms):
    is_simple = True

    def __init__(self, pretrained: str, max_turns: int | None = None, batch_size: int = 8,
                 engine: str = "auto", served_model: str = "default", recipe: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        from pipelines.agent.policies import make_policy
        from pipelines.config.recipe import load_recipe

        overrides = [f"agent.max_turns_eval={int(max_turns)}"] if max_turns is not None else []
        self.recipe = load_recipe(recipe, overrides)
        self.batch_size_per_gpu = int(batch_size)
        self.policy = make_policy(str(pretrained), engine=engine, served_model=served_model,
                                  agent_cfg=self.recipe.agent, device=self.recipe.model.device,
                                  dtype=self.recipe.model.dtype,
                                  concurrency=self.recipe.eval.concurrency,
                                  client=self.recipe.eval.client)
        # Decoded PIL visuals are written here for the sandbox; removed with the model object.
        self._media_dir = tempfile.TemporaryDirectory(prefix="pyvision-lmms-")
        self._media = Path(self._media_dir.name)
        self.trajectories: list[dict] = []

    def _task(self, i: int, context: str, visuals: list[Any]) -> Task:
        images, video = [], None
        for k, v in enumerate(visuals or []):
            if isinstance(v, str) and Path(v).suffix.lower() in (".mp4", ".webm", ".mkv", ".avi", ".mov"):
                video = v
            elif isinstance(v, str):
                images.append(v)
            elif isinstance(v, dict) and v.get("path"):
                images.append(v["path"])
            else:  # PIL image
                path = self._media / f"req{i}_{k}.png"
                to_rgb(v).save(path)
                images.append(str(path))
        return Task(id=f"req-{i}", data_source="lmms-eval", question=context, images=images,
                    video=video, answer="?", answer_type="text")

    def generate_until(self, requests) -> list[str]:
        from pipelines.agent.loop import run_episodes

        items = []
        for i, req in enumerate(requests):
            context, _gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            doc = self.task_dict[task][split][doc_id]
            items.append((self._task(i, context, doc_to_visual(doc)), Path("/")))
        answers: dict[str, str] = {}
        for traj in run_episodes(items, self.policy, self.recipe.agent, self.recipe.sandbox,
                                 mode="eval", batch_size=self.batch_size_per_gpu):
            answers[traj.task_id] = traj.final_answer or ""
            self.trajectories.append(traj.to_json())
        return [answers[f"req-{i}"] for i in range(len(requests))]

    def generate_until_multi_round(self, requests) -> list[str]:
        return self.generate_until(requests)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        raise NotImplementedError("pyvision_agent answers by running an agent loop; log-likelihood "
                                  "tasks (multiple-choice by likelihood) need a plain model")
