"""`pyvision agent run`: one trajectory, shown turn by turn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pyvision_cli.common import (
    COMMAND_HELP,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    command,
    err,
    load_recipe,
    make_app,
    print_json,
)

app = make_app(COMMAND_HELP["agent"], group=True)


@command(app, "run")
def run(
    model: Annotated[str, typer.Option(help="Local model folder, or http(s) URL of an OpenAI-compatible server.")],
    question: Annotated[str, typer.Option(help="The question to answer.")],
    image: Annotated[list[Path] | None, typer.Option(help="Input image(s): image_clue_0, ...")] = None,
    video: Annotated[Path | None, typer.Option(help="Input video: video_clue_0 (on-demand context).")] = None,
    served_model: Annotated[str | None, typer.Option(help="Model name sent to a server URL (default: the one model the server lists).", show_default=False)] = None,
    max_turns: Annotated[int | None, typer.Option(help="Most assistant turns [default: agent.max_turns_eval].", min=1)] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature [default: agent.eval_temperature].", min=0.0)] = None,
    out_dir: Annotated[Path | None, typer.Option(help="Folder for the trajectory and its images [default: a temp dir].")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Missing or corrupt media are reported before any generation (exit 2)."""
    import tempfile

    from rich.markup import escape
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.text import Text

    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies import make_policy
    from pipelines.console import terminal_safe
    from pipelines.core.records import Task
    from pipelines.errors import UserError

    if bool(image) == bool(video):
        raise UserError("pass either --image (one or more) or --video", hint="e.g. --image photo.jpg")
    from pipelines.inputs import check_model, check_writable_dir

    check_model(model)
    if model.startswith(("http://", "https://")):  # one line now, not retries and then a line
        from pipelines.eval.runner import check_endpoint

        check_endpoint(model, hint="start it (e.g. `vllm serve MODEL --port 8000`) and pass its "
                                   "URL to --model")
    if out_dir is not None:
        check_writable_dir(out_dir, "--out-dir")
    overrides = list(set_ or [])
    if max_turns is not None:
        overrides.append(f"agent.max_turns_eval={max_turns}")
    if temperature is not None:
        overrides.append(f"agent.eval_temperature={temperature}")
    recipe = load_recipe(config, overrides)
    task = Task(id="cli", data_source="cli", question=question,
                images=[str(p.resolve()) for p in image or []],
                video=str(video.resolve()) if video else None, answer="?", answer_type="text")
    from pipelines.agent.prompts import build_initial_messages, check_video, variant_for

    check_video(video)
    build_initial_messages(task, Path("/"), variant_for(task, recipe.agent), recipe.agent)  # validates media
    policy = make_policy(model, served_model=served_model, agent_cfg=recipe.agent,
                         device=recipe.model.device, dtype=recipe.model.dtype,
                         client=recipe.eval.client,
                         url_hint="start it (e.g. `vllm serve MODEL --port 8000`) and pass its "
                                  "URL to --model", model_hint="pass --served-model NAME")
    from pipelines.eval.runner import seed_eval_sampling

    seed_eval_sampling(recipe, "openai" if model.startswith(("http://", "https://")) else None)
    (traj,) = list(run_episodes([(task, Path("/"))], policy, recipe.agent, recipe.sandbox,
                                mode="eval", batch_size=1))
    out = out_dir or Path(tempfile.mkdtemp(prefix="pyvision-agent-"))
    path = traj.save(out)
    if json_out:
        print_json(traj.to_json() | {"trajectory_file": str(path)})
        return
    # Model text and interpreter output are shown as text (never read as Rich markup: "[/b]"
    # crashed the command) with their control characters escaped.
    for i, turn in enumerate(traj.turns, start=1):
        err.print(Panel(Text(terminal_safe(turn.assistant or "(empty)")),
                        title=f"assistant turn {i}", border_style="cyan"))
        if turn.code:
            err.print(Syntax(terminal_safe(turn.code), "python", theme="ansi_dark",
                             line_numbers=True))
        if turn.result is not None:
            body = turn.result.stdout or ""
            if turn.result.status != "ok":
                body += f"\n[{turn.result.status}] {turn.result.stderr}"
            images = ", ".join(str(out / f"image_{k}.png") for k in turn.image_indices)
            err.print(Panel(Text(terminal_safe(body.strip() + (f"\nimages: {images}" if images
                                                                else ""))),
                            title=f"interpreter ({turn.result.status}, {turn.result.duration_s:.2f} s)",
                            border_style="green" if turn.result.status == "ok" else "red"))
    err.print(f"[bold]answer:[/] {escape(terminal_safe(repr(traj.final_answer)))}  stop: "
              f"{traj.stop_reason}  turns: {traj.num_turns}  tool calls: {traj.tool_calls}  "
              f"visual tokens: {traj.visual_tokens}")
    err.print(f"saved to {escape(str(path))}")
