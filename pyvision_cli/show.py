"""`pyvision show RUN`: trajectories in the terminal, drawn with Rich."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pyvision_cli.common import COMMAND_HELP, JsonOpt, StoreOpt, command, err, make_app, print_json

app = make_app(COMMAND_HELP["show"])


@command(app)
def show(
    run: Annotated[str, typer.Argument(help="Run id, as in `pyvision report`.")],
    model: Annotated[list[str] | None, typer.Option("--model", help="Model tag (base, sft, rl, ...; repeatable) [default: all]; RUN2/TAG names another run's.")] = None,
    benchmark: Annotated[str | None, typer.Option("--benchmark", help="Only this benchmark.")] = None,
    sample: Annotated[str | None, typer.Option("--sample", help="Show this sample turn by turn, every selected model one after the other.")] = None,
    changed: Annotated[tuple[str, str] | None, typer.Option("--changed", metavar="A B", help="List the samples whose verdict changed from model A to model B.")] = None,
    verdict: Annotated[str | None, typer.Option("--verdict", help="Only right | wrong | partial | unscored samples (in the list).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Rows listed at most.")] = 50,
    images: Annotated[str, typer.Option("--images", help="auto (inline where the terminal can, else paths) | inline | paths | none")] = "auto",
    media_dir: Annotated[Path | None, typer.Option("--media-dir", help="Where thumbnails are written for their paths [default: media/ next to the store].")] = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Without --sample or --changed, list the run's samples with their verdicts.

    --sample ID draws that sample: question, gold answer, input images, then for each model its
    verdict, the scorer that decided it, turns, tool calls, visual tokens, stop reason and every
    turn (text, highlighted code, interpreter output and images). --changed A B lists the
    samples that A and B both answered with different verdicts (fixed, broken).
    """
    from pipelines.errors import UserError
    from pipelines.report import terminal as t
    from pipelines.report.trajectories import verdict_changes
    from pipelines.store import Store

    if sample is not None and changed is not None:
        raise UserError("--sample and --changed cannot be combined",
                        hint="list the changes with --changed A B, then show one with --sample ID")
    if changed is not None and (verdict is not None or model):
        # --changed A B names its two models, and a change is fixed or broken, not a verdict.
        raise UserError(f"--{'verdict' if verdict is not None else 'model'} does not apply to "
                        "--changed A B", hint="drop it: --changed lists the samples whose "
                        "verdict differs between A and B (fixed, broken)")
    st = Store(store, read_only=True)
    a, b = (t.model_key(run, m) for m in changed) if changed else (None, None)
    models = [t.model_key(run, m) for m in model or []]
    others = sorted({k.split("/", 1)[0] for k in [*models, a or "", b or ""] if "/" in k} - {run})
    ts = t.load(st, run, others)
    shown = t.Images(st, err, images, media_dir or Path(st.path).resolve().parent / "media")
    if sample is not None and (shown.mode == "paths" or (json_out and shown.mode != "none")):
        from pipelines.inputs import check_writable_dir

        # Thumbnails will be written there: a bad folder is one line now, not a traceback
        # half way through drawing the sample.
        check_writable_dir(shown.media_dir, "--media-dir" if media_dir else "media folder")
    if changed:
        t.select(ts, models=[a, b], benchmark=benchmark)  # checks the names
        changes = verdict_changes(ts, a, b, benchmark)
        if json_out:
            print_json({"a": a, "b": b, "changes": [
                {"benchmark": c["benchmark"], "sample_id": c["sample_id"], "change": c["change"],
                 "a": t.entry_json(ts, c["a"], None), "b": t.entry_json(ts, c["b"], None)}
                for c in changes]})
            return
        t.render_changes(err, changes, a, b, limit)
        return
    if models or sample is not None:
        entries = t.select(ts, models=models or [m["key"] for m in ts.models
                                                 if m["run"] == run],
                           benchmark=benchmark, sample=sample, verdict=verdict)
    else:
        entries = t.select(ts, benchmark=benchmark, verdict=verdict)
    if json_out:
        print_json([t.entry_json(ts, e, shown if sample is not None else None)
                    for e in entries[:limit]])
        return
    if sample is None:
        t.render_list(err, ts, entries, limit)
        return
    by_benchmark: dict[str, list[dict]] = {}
    for e in entries:
        by_benchmark.setdefault(ts.samples[e["s"]]["benchmark"], []).append(e)
    for group in by_benchmark.values():
        t.render_sample(err, ts, group, shown)
