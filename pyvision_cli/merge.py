"""`pyvision merge`: LoRA adapters (LLaMA-Factory export) and verl checkpoints (verl merger)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.markup import escape

from pyvision_cli.common import COMMAND_HELP, JsonOpt, command, err, make_app, print_json

app = make_app(COMMAND_HELP["merge"], no_args_is_help=True)


@command(app)
def merge(
    out: Annotated[Path, typer.Option("--out", help="Folder for the merged model.")],
    engine: Annotated[Literal["lora", "verl"], typer.Option(help="`lora`: LoRA adapter (SFT's via LLaMA-Factory, LoRA RL's via peft); "
                                              "`verl`: verl FSDP checkpoint via verl.model_merger.")] = "lora",
    lora: Annotated[Path | None, typer.Option(help="LoRA adapter folder (engine lora).")] = None,
    base: Annotated[str | None, typer.Option(help="Base model path or hub id (engine lora).")] = None,
    checkpoint: Annotated[Path | None, typer.Option(help="verl checkpoint: global_step_N/actor, "
                                                            "global_step_N, or their parent (engine verl).")] = None,
    template: Annotated[str | None, typer.Option(help="LLaMA-Factory chat template of the SFT run "
                                                 "(engine lora; default: the adapter's run's "
                                                 "sft.template, or qwen2_vl for a Qwen2/2.5-VL base).")] = None,
    python: Annotated[str, typer.Option(help="Interpreter that has llamafactory / verl.")] = "python",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out folder.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Merge, then check the result loads (config, processor, weight names and shapes)."""
    from pipelines.errors import UserError
    from pipelines.inputs import check_writable_dir
    from pipelines.merge import merge_verl
    from pipelines.sft.lora import merge_lora

    check_writable_dir(out, "--out")

    if engine == "lora":
        if lora is None or base is None:
            raise UserError("--engine lora needs --lora ADAPTER and --base MODEL",
                            hint="e.g. pyvision merge --lora runs/x/sft/output --base MODEL --out DIR")
        info = merge_lora(lora, base, out, python=python, template=template, force=force)
    else:
        if checkpoint is None:
            raise UserError("--engine verl needs --checkpoint DIR",
                            hint="e.g. pyvision merge --engine verl --checkpoint ckpts/global_step_50 --out DIR")
        info = merge_verl(checkpoint, out, python=python, force=force)
    err.print(f"[green]merged[/] into {escape(str(info['path']))} ({info['parameters']:,} parameters, "
              f"{'loaded and ran a forward pass' if info['full_load'] else 'weights checked'})")
    if json_out:
        print_json(info)
