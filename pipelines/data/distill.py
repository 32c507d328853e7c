"""Cold-start SFT data from a teacher model: `pyvision data distill`.

Any OpenAI-compatible vision model (vLLM serving Qwen2.5-VL-72B, a hosted API with a key from the
environment, ``transformers serve`` locally) becomes the policy of **our** agent loop
(:func:`pipelines.agent.loop.run_episodes`): the same prompts, protocol and sandbox as training
and evaluation, so what the teacher's code printed is what our sandbox printed. Each task is drawn
``k`` times. A trajectory is kept only when it passes verification, in this order (the first
failed check is its rejection reason):

``stop:<reason>``   it did not end with an answer (max turns, context overflow, image limit, no
                    code nor answer, tool error);
``format``          a turn is not exact protocol (:func:`pipelines.agent.protocol.format_problems`)
                    or was cut off by the token limit;
``code_error``      a code block failed (with ``allow_fixed_errors``: a failure not followed by a
                    block that ran);
``too_many_turns`` / ``too_long``  over the turn or token limit of the recipe;
``answer_too_long`` / ``wrong_answer``  the reward's verdict: :func:`pipelines.scoring.reward.
                    compute_reward`, i.e. :func:`benchmarks.scoring.verify` (the synthetic
                    benchmarks' scorer too), and the judge where the recipe has one.

Selection, a pure function of the verified samples and the seed: per task, duplicates of code
(exact, or at least ``near_duplicate`` similar) go, the rest are ranked (tool use first where the
task needs it: on-demand video, image-in-sandbox prompts, visual search; then fewer turns, fewer
tokens, then a seeded tie-break), the best ``max_per_task`` stay; then no family (or family and
turn count) keeps more than ``balance_ratio`` times the median group.

Output (``out``): ``samples/`` holds every teacher sample as drawn (``trajectory.json`` and its
images, one folder each, written atomically, listed in ``samples/index.jsonl``): a re-run draws
only the samples missing, so an interrupted or failed run resumes with nothing drawn twice.
Once all are drawn: ``conversations.jsonl`` + ``media/`` (canonical conversations, like
``pyvision data trajectories``), ``pyvision_distill.jsonl`` registered in ``dataset_info.json``
(LLaMA-Factory ShareGPT, by :func:`~pipelines.data.export_llamafactory.export_llamafactory`),
``card.json`` / ``card.md`` (the data card, also stored in the DuckDB store) and, last,
``manifest.json``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from pipelines.agent.trajectory import Trajectory
from pipelines.config.recipe import Recipe
from pipelines.console import StatusProgress, err
from pipelines.core.records import Task, read_tasks, write_conversations
from pipelines.errors import DataError, EndpointError, UserError
from pipelines.fsutil import atomic_write_json, atomic_write_text, publish_dir_mode

DATASET_NAME = "pyvision_distill"
INDEX = "index.jsonl"
FAILED_DRAIN_S = 30.0
"""How long a distillation that lost its teacher waits for the requests still in flight."""
SETTINGS = "settings.json"
TEACHER_HINT = ("start it (e.g. `vllm serve Qwen/Qwen2.5-VL-72B-Instruct --port 8000`, or "
                "`transformers serve MODEL --port 8000`) and pass its URL to --teacher (in a "
                "recipe: data.distill.teacher)")


# -- verification ------------------------------------------------------------------------------


def needs_tools(task: Task, traj: Trajectory) -> bool:
    """Whether a good answer to ``task`` uses code: ``metadata["needs_tools"]`` when set; else
    prompts whose media is only in the sandbox (on-demand video, ``image_noinit``) and visual
    search (small targets on large images)."""
    from pipelines.scoring.judge import family_of

    flag = task.metadata.get("needs_tools")
    if isinstance(flag, bool):
        return flag
    return traj.variant in ("video", "image_noinit") or family_of(task.data_source) == \
        "visual_search"


def check(traj: Trajectory, task: Task, recipe: Recipe, *, max_turns: int, max_tokens: int,
          judge: Any = None) -> str:
    """``accepted``, or why ``traj`` is rejected (see the module docstring)."""
    from pipelines.agent.protocol import format_problems
    from pipelines.scoring.reward import compute_reward

    cfg = recipe.data.distill
    if traj.stop_reason != "answered":
        return f"stop:{traj.stop_reason}"
    if format_problems([t.assistant for t in traj.turns]) or any(
            t.finish == "length" for t in traj.turns):
        return "format"
    statuses = [t.result.status == "ok" for t in traj.turns if t.result is not None]
    if not all(statuses) and not (cfg.allow_fixed_errors and statuses and statuses[-1]):
        return "code_error"
    if traj.num_turns > max_turns:
        return "too_many_turns"
    if traj.prompt_tokens + traj.generated_tokens + traj.observation_tokens > max_tokens:
        return "too_long"
    r = compute_reward(task, traj.final_answer, answer_chars=traj.answer_chars,
                       successful_tool_calls=traj.successful_calls, well_formed=True,
                       cfg=recipe.reward, judge=judge)
    if r.scorer == "length-guard":
        return "answer_too_long"
    return "accepted" if r.correct else "wrong_answer"


# -- selection -----------------------------------------------------------------------------------


@dataclass
class Candidate:
    """One verified sample, as selection sees it."""

    task_id: str
    sample: int
    family: str
    turns: int
    tokens: int
    successful_calls: int
    needs_tools: bool
    signature: str
    outcome: str = ""
    rank: int = 0
    key: str = field(default="", repr=False)


_COMMENT_RE = re.compile(r"#[^\n]*")


def signature(traj: Trajectory) -> str:
    """What duplicates share: the trajectory's code, comments and spacing dropped (its text
    when it wrote no code)."""
    code = [t.code for t in traj.turns if t.code]
    text = "\n".join(code) if code else "\n".join(t.assistant for t in traj.turns)
    if code:
        text = _COMMENT_RE.sub("", text)
    return " ".join(text.split())


def select(candidates: list[Candidate], *, max_per_task: int, balance: str, ratio: float,
           near_duplicate: float, seed: int) -> list[Candidate]:
    """Mark every candidate's ``outcome`` (kept / duplicate / over_max_per_task / balance);
    returns the kept ones, sorted. Depends only on the candidates and ``seed``."""
    by_task: dict[str, list[Candidate]] = defaultdict(list)
    for c in sorted(candidates, key=lambda c: (c.task_id, c.sample)):
        c.key = hashlib.sha256(f"{seed}:{c.task_id}:{c.sample}".encode()).hexdigest()
        by_task[c.task_id].append(c)
    picked: list[Candidate] = []
    for cands in by_task.values():
        cands.sort(key=lambda c: (c.needs_tools and c.successful_calls == 0, c.turns, c.tokens,
                                  c.key))
        kept: list[Candidate] = []
        for c in cands:
            if any(c.signature == k.signature or (near_duplicate < 1.0 and difflib.SequenceMatcher(
                    None, c.signature, k.signature, autojunk=False).ratio() >= near_duplicate)
                   for k in kept):
                c.outcome = "duplicate"
            elif len(kept) >= max_per_task:
                c.outcome = "over_max_per_task"
            else:
                c.rank, c.outcome = len(kept), "kept"
                kept.append(c)
        picked += kept
    if balance != "none" and picked:
        groups: dict[tuple, list[Candidate]] = defaultdict(list)
        for c in picked:
            bucket = min(c.turns, 4) if balance == "family_and_turns" else 0
            groups[(c.family, bucket)].append(c)
        cap = math.ceil(ratio * statistics.median(len(g) for g in groups.values()))
        for members in groups.values():
            members.sort(key=lambda c: (c.rank, c.key))
            for c in members[cap:]:
                c.outcome = "balance"
    return sorted((c for c in picked if c.outcome == "kept"), key=lambda c: (c.task_id, c.sample))


# -- drawing -------------------------------------------------------------------------------------


def _sample_dir(out: Path, task_id: str, sample: int) -> Path:
    return out / "samples" / hashlib.sha1(task_id.encode()).hexdigest()[:16] / str(sample)


def _read_index(out: Path) -> dict[tuple[str, int], Path]:
    """Samples drawn so far (whose folder is complete); a torn last line is ignored."""
    path = out / "samples" / INDEX
    done: dict[tuple[str, int], Path] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            key = (str(row["task_id"]), int(row["sample"]))
        except (ValueError, KeyError, TypeError):
            continue
        folder = _sample_dir(out, *key)
        if (folder / "trajectory.json").is_file():
            done[key] = folder
    return done


def _save_sample(out: Path, traj: Trajectory, sample: int) -> Path:
    """Write one sample's folder atomically, then list it in the index."""
    folder = _sample_dir(out, traj.task_id, sample)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sample}.", dir=folder.parent))
    try:
        publish_dir_mode(tmp)
        traj.save(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with open(out / "samples" / INDEX, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"task_id": traj.task_id, "sample": sample}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return folder


def _load_tasks(task_dirs: Iterable[str | Path], strict: bool) -> list[tuple[Task, Path]]:
    items: list[tuple[Task, Path]] = []
    seen: dict[str, Path] = {}
    for d in task_dirs:
        path = Path(d)
        tasks, _report = read_tasks(path, strict=strict)
        root = path if path.is_dir() else path.parent
        for task in tasks:
            if task.id in seen:
                raise DataError(f"task id '{task.id}' is in both {seen[task.id]} and {path}",
                                hint="distill folders whose task ids differ")
            seen[task.id] = path
            items.append((task, root))
    if not items:
        raise DataError(f"no tasks to distill in {', '.join(str(d) for d in task_dirs)}",
                        hint="pass --tasks folders holding tasks.jsonl (`pyvision data synth` "
                             "or `pyvision data import`)")
    return items


def _settings(recipe: Recipe, model: str, max_turns: int) -> dict[str, Any]:
    """What makes two samples comparable (drawn the same way)."""
    from pipelines.agent.prompts import CURRENT

    d, a = recipe.data.distill, recipe.agent
    return {"served_model": model, "temperature": d.temperature, "top_p": d.top_p,
            "max_new_tokens_per_turn": d.max_new_tokens_per_turn or a.max_new_tokens_per_turn,
            "max_turns": max_turns, "max_context_tokens": a.max_context_tokens,
            "max_images": a.max_images, "image_min_pixels": a.image_min_pixels,
            "image_max_pixels": a.image_max_pixels, "on_error": a.on_error,
            "video_context": a.video_context, "prompts": dict(CURRENT)}


def _check_settings(out: Path, settings: dict[str, Any], force: bool, drawn: int) -> None:
    path = out / "samples" / SETTINGS
    if force and (out / "samples").exists():
        shutil.rmtree(out / "samples")
        drawn = 0
    if path.is_file() and drawn:
        old = json.loads(path.read_text(encoding="utf-8"))
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v]
        if changed:
            raise UserError(f"{out} holds {drawn} samples drawn with other settings "
                            f"({'; '.join(changed[:3])})", hint="pass --force to discard them and "
                            "draw again, or another --out")
    atomic_write_json(path, settings)


def check_teacher(url: str) -> None:
    """The teacher's server answers (any HTTP answer), else one line: EndpointError."""
    from pipelines.eval.runner import check_endpoint

    check_endpoint(url, what="teacher", hint=TEACHER_HINT,
                   not_url_hint="pass the teacher server's URL, e.g. http://localhost:8000/v1")


def distill(recipe: Recipe, task_dirs: list[str | Path], out: str | Path, *,
            teacher: str | None = None, served_model: str | None = None, k: int | None = None,
            store: Any = None, run_id: str | None = None, force: bool = False,
            limit: int | None = None, progress: bool = True, policy: Any = None) -> dict[str, Any]:
    """Draw, verify, select and export (see the module docstring); returns the data card.

    ``teacher`` / ``served_model`` / ``k`` override ``recipe.data.distill``; ``policy`` replaces
    the teacher client (tests). ``store`` (a :class:`pipelines.store.Store`) gets the card and a
    row per sample."""
    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies.base import Sampling
    from pipelines.agent.policies.endpoint import Cancelled

    cfg = recipe.data.distill
    teacher = teacher or cfg.teacher
    if policy is None and not teacher:
        raise UserError("no teacher to distill from", hint="pass --teacher URL (or set "
                        "data.distill.teacher in the recipe)")
    k = k or cfg.k
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file", hint="pass a folder")
    items = _load_tasks(task_dirs, recipe.data.strict)
    items = items[:limit] if limit else items
    tasks = {t.id: t for t, _ in items}
    max_turns = cfg.max_turns or recipe.agent.max_turns_train
    max_tokens = cfg.max_tokens or recipe.sft.cutoff_len
    agent = recipe.agent.model_copy(update={"max_turns_train": max_turns})
    sampling = Sampling(cfg.max_new_tokens_per_turn or agent.max_new_tokens_per_turn,
                        cfg.temperature, cfg.top_p)
    if policy is None:
        from pipelines.agent.policies.openai import OpenAIPolicy

        check_teacher(teacher)
        policy = OpenAIPolicy(teacher, served_model or cfg.served_model, client=cfg.client,
                              concurrency=cfg.concurrency,
                              image_min_pixels=agent.image_min_pixels,
                              image_max_pixels=agent.image_max_pixels,
                              image_factor=agent.image_factor, role="teacher",
                              url_hint=TEACHER_HINT, model_hint="pass --served-model NAME")
    model = getattr(policy, "model", None) or policy.name
    out.mkdir(parents=True, exist_ok=True)
    done = _read_index(out)
    _check_settings(out, _settings(recipe, model, max_turns), force, len(done))
    if force:
        done = {}
    pending = [(task, root, s) for task, root in items for s in range(k)
               if (task.id, s) not in done]
    if pending:
        # The finished output is about to change: until it is rewritten it is not finished.
        (out / "manifest.json").unlink(missing_ok=True)
    judge = None
    if recipe.reward.judge.base_url:
        from pipelines.scoring.judge import Judge

        judge = Judge(recipe.reward.judge, store=store)

    total = len(items) * k
    counts: Counter[str] = Counter()
    bar = StatusProgress(progress and bool(pending), "distill", total, total - len(pending),
                         status=getattr(policy, "activity", None))
    start = time.monotonic()
    drawn = 0
    try:
        episodes = run_episodes([(t, r) for t, r, _ in pending], policy, agent,
                                recipe.sandbox, mode="train", batch_size=cfg.concurrency,
                                sampling=sampling)
        for traj in episodes:
            _task, _root, sample = pending[traj.group_index]
            traj.sample_index = sample
            done[(traj.task_id, sample)] = _save_sample(out, traj, sample)
            drawn += 1
            counts[check(traj, tasks[traj.task_id], recipe, max_turns=max_turns,
                         max_tokens=max_tokens, judge=judge) == "accepted"] += 1
            n = counts[True] + counts[False]
            bar.advance(label=f"distill: accepted {counts[True]} of {n} "
                              f"({100 * counts[True] / n:.0f}%)")
    except (EndpointError, KeyboardInterrupt, Cancelled) as exc:
        bar.close()
        close = getattr(policy, "close", None)
        if close is not None:
            # After a failure the requests still in flight fail fast: wait for every one, so
            # none reaches a teacher brought back on the same port (Ctrl-C waits 2 s at most).
            close(**({"drain_s": FAILED_DRAIN_S} if isinstance(exc, EndpointError) else {}))
        kept = (f"the {drawn} samples drawn in this run are kept in {out / 'samples'}; run the "
                "same command again to draw the rest")
        if isinstance(exc, EndpointError):
            raise EndpointError(f"{exc.message} ({kept})", hint=exc.hint) from None
        err.print(f"[yellow]interrupted:[/] {escape(kept)}", soft_wrap=True)
        raise
    finally:
        bar.close()
    seconds = time.monotonic() - start
    card = _finish(out, recipe, items, done, k=k, teacher=teacher or model, model=model,
                   server=getattr(getattr(policy, "client", None), "server", None),
                   sampling=sampling, max_turns=max_turns, max_tokens=max_tokens, judge=judge,
                   store=store, run_id=run_id,
                   run={"drawn": drawn, "seconds": round(seconds, 2),
                        "samples_per_s": round(drawn / seconds, 3) if drawn and seconds else None})
    return card


def _finish(out: Path, recipe: Recipe, items: list[tuple[Task, Path]],
            done: dict[tuple[str, int], Path], *, k: int, teacher: str, model: str,
            server: str | None, sampling: Any, max_turns: int, max_tokens: int, judge: Any,
            store: Any, run_id: str | None, run: dict[str, Any]) -> dict[str, Any]:
    """Verify every drawn sample, select, export, and write the card and manifest."""
    from pipelines.data.export_llamafactory import export_llamafactory

    cfg = recipe.data.distill
    rows: list[dict[str, Any]] = []
    cands: list[Candidate] = []
    usage: Counter[str] = Counter()
    cost_reported = False
    for task, _root in items:
        family = str(task.metadata.get("family") or task.data_source)
        for s in range(k):
            folder = done.get((task.id, s))
            if folder is None:
                continue
            traj = Trajectory.load(folder, images=False)
            verdict = check(traj, task, recipe, max_turns=max_turns, max_tokens=max_tokens,
                            judge=judge)
            tokens = traj.prompt_tokens + traj.generated_tokens + traj.observation_tokens
            for key, value in (traj.request_usage or {}).items():
                usage[key] += value
            cost_reported = cost_reported or "cost" in (traj.request_usage or {})
            row = {"task_id": task.id, "sample_index": s, "family": family,
                   "data_source": task.data_source, "verdict": verdict, "kept": False,
                   "selection": None, "turns": traj.num_turns, "tool_calls": traj.tool_calls,
                   "failed_calls": traj.failed_calls, "total_tokens": tokens,
                   "visual_tokens": traj.visual_tokens}
            rows.append(row)
            if verdict == "accepted":
                cands.append(Candidate(task.id, s, family, traj.num_turns, tokens,
                                       traj.successful_calls, needs_tools(task, traj),
                                       signature(traj)))
    kept = select(cands, max_per_task=cfg.max_per_task, balance=cfg.balance,
                  ratio=cfg.balance_ratio, near_duplicate=cfg.near_duplicate, seed=recipe.seed)
    outcome = {(c.task_id, c.sample): c.outcome for c in cands}
    for row in rows:
        row["selection"] = outcome.get((row["task_id"], row["sample_index"]))
        row["kept"] = row["selection"] == "kept"

    # The SFT data: conversations + media, then the LLaMA-Factory export of them.
    media = out / "media"
    if media.exists():
        shutil.rmtree(media)
    convs = []
    trajs: dict[tuple[str, int], Trajectory] = {}
    for c in kept:
        trajs[(c.task_id, c.sample)] = Trajectory.load(done[(c.task_id, c.sample)])
        conv_id = "distill-" + hashlib.sha1(f"{c.task_id}\0{c.sample}".encode()).hexdigest()[:16]
        conv = trajs[(c.task_id, c.sample)].to_conversation(conv_id, media, "media/")
        convs.append(conv.model_copy(update={"metadata": {
            **conv.metadata, "sample": c.sample, "family": c.family, "teacher": model}}))
    write_conversations(out / "conversations.jsonl", convs)
    exported = None
    if convs:
        exported = export_llamafactory([(out, convs)], out, name=DATASET_NAME,
                                       agent_cfg=recipe.agent)
    card = _card(rows, kept, trajs, items, k=k, teacher=teacher, model=model, server=server,
                 sampling=sampling, max_turns=max_turns, max_tokens=max_tokens, recipe=recipe,
                 usage=usage, cost_reported=cost_reported, run=run, exported=exported)
    atomic_write_json(out / "card.json", card)
    atomic_write_text(out / "card.md", card_markdown(card))
    if store is not None:
        store.put_distill(str(out.resolve()), run_id=run_id, teacher=teacher, card=card,
                          samples=rows)
    atomic_write_json(out / "manifest.json", {
        "kind": "distill", "conversations": "conversations.jsonl", "dataset_dir": str(out),
        "dataset": DATASET_NAME if convs else None, "kept": len(convs), "card": "card.json"})
    return card


def _hist(values: Iterable[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def _card(rows: list[dict[str, Any]], kept: list[Candidate],
          trajs: dict[tuple[str, int], Trajectory], items: list[tuple[Task, Path]], *, k: int,
          teacher: str, model: str, server: str | None, sampling: Any, max_turns: int,
          max_tokens: int, recipe: Recipe, usage: Counter[str], cost_reported: bool,
          run: dict[str, Any], exported: dict[str, Any] | None) -> dict[str, Any]:
    cfg = recipe.data.distill
    families: dict[str, dict[str, Any]] = {}
    for row in rows:
        f = families.setdefault(row["family"], {"tasks": set(), "samples": 0, "accepted": 0,
                                                "kept": 0, "rejected": Counter()})
        f["tasks"].add(row["task_id"])
        f["samples"] += 1
        f["accepted"] += row["verdict"] == "accepted"
        f["kept"] += row["kept"]
        if row["verdict"] != "accepted":
            f["rejected"][row["verdict"]] += 1
    by_family = {name: {"tasks": len(f["tasks"]), "samples": f["samples"],
                        "accepted": f["accepted"],
                        "acceptance": round(f["accepted"] / f["samples"], 4),
                        "kept": f["kept"], "rejected": dict(sorted(f["rejected"].items()))}
                 for name, f in sorted(families.items())}
    kept_trajs = [trajs[(c.task_id, c.sample)] for c in kept]
    accepted = sum(r["verdict"] == "accepted" for r in rows)
    drawn = len(rows)

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None


    tokens = {key: int(value) for key, value in usage.items() if key != "cost"}
    if cost_reported:
        tokens["cost"] = round(float(usage["cost"]), 6)
    return {
        "teacher": {"url": teacher, "served_model": model, "server": server,
                    "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                 "max_new_tokens_per_turn": sampling.max_new_tokens},
                    "k": k},
        "tasks": {"tried": len(items), "with_samples": len({r["task_id"] for r in rows}),
                  "with_kept_data": len({c.task_id for c in kept})},
        "samples": {"drawn": drawn, "accepted": accepted,
                    "acceptance": round(accepted / drawn, 4) if drawn else None,
                    "rejected": dict(Counter(r["verdict"] for r in rows
                                             if r["verdict"] != "accepted").most_common())},
        "by_family": by_family,
        "selection": {"kept": len(kept), "max_per_task": cfg.max_per_task,
                      "balance": cfg.balance, "balance_ratio": cfg.balance_ratio,
                      "near_duplicate": cfg.near_duplicate, "seed": recipe.seed,
                      "dropped": dict(Counter(r["selection"] for r in rows
                                              if r["selection"] not in (None, "kept")))},
        "kept": {"turns": _hist(t.num_turns for t in kept_trajs),
                 "tool_calls": _hist(t.tool_calls for t in kept_trajs),
                 "mean_turns": mean([t.num_turns for t in kept_trajs]),
                 "mean_tool_calls": mean([t.tool_calls for t in kept_trajs]),
                 "visual_tokens": sum(t.visual_tokens for t in kept_trajs),
                 "mean_visual_tokens": mean([t.visual_tokens for t in kept_trajs]),
                 "images": sum(len(t.images) for t in kept_trajs)},
        "verification": {"answer": "pipelines.scoring.reward.compute_reward (benchmarks.scoring."
                                   "verify" + ("; judge " + recipe.reward.judge.model
                                               if recipe.reward.judge.base_url else "") + ")",
                         "allow_fixed_errors": cfg.allow_fixed_errors, "max_turns": max_turns,
                         "max_tokens": max_tokens},
        "usage": tokens,
        "run": run,
        "export": exported,
    }


def card_markdown(card: dict[str, Any]) -> str:
    """The data card as Markdown (beside ``card.json``)."""
    t, s, sel, kept = card["teacher"], card["samples"], card["selection"], card["kept"]
    pct = (lambda x: "-" if x is None else f"{100 * x:.1f}%")
    lines = [
        "# Distilled SFT data: data card", "",
        (f"- Teacher: `{t['served_model']}` at {t['url']} (server: {t['server'] or 'n/a'}); "
        f"temperature {t['sampling']['temperature']}, top-p {t['sampling']['top_p']}, "
        f"{t['sampling']['max_new_tokens_per_turn']} tokens per turn, k = {t['k']} per task"),
        (f"- Tasks tried: {card['tasks']['tried']}; with kept data: "
        f"{card['tasks']['with_kept_data']}"),
        (f"- Samples drawn: {s['drawn']}; verified: {s['accepted']} ({pct(s['acceptance'])}); "
        f"kept after selection: {sel['kept']}"),
        (f"- Verification: answer by {card['verification']['answer']}; at most "
        f"{card['verification']['max_turns']} turns and {card['verification']['max_tokens']} "
        f"tokens; fixed code errors "
        f"{'allowed' if card['verification']['allow_fixed_errors'] else 'rejected'}"),
        (f"- Selection: at most {sel['max_per_task']} per task, balance `{sel['balance']}` "
        f"(ratio {sel['balance_ratio']}), near duplicates at {sel['near_duplicate']}, seed "
        f"{sel['seed']}; dropped: {sel['dropped'] or 'none'}"),
        "", "## Acceptance by family", "",
        "| family | tasks | samples | verified | acceptance | kept | rejected |",
        "|---|---|---|---|---|---|---|"]
    for name, f in card["by_family"].items():
        rejected = ", ".join(f"{k} {v}" for k, v in f["rejected"].items()) or "-"
        lines.append(f"| {name} | {f['tasks']} | {f['samples']} | {f['accepted']} | "
                     f"{pct(f['acceptance'])} | {f['kept']} | {rejected} |")
    lines += ["", "## Rejections", "", "| reason | samples |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in s["rejected"].items()] or ["| - | 0 |"]
    lines += ["", "## Kept trajectories", "",
              f"- Turns: {kept['turns'] or '-'} (mean {kept['mean_turns'] or '-'})",
              f"- Tool calls: {kept['tool_calls'] or '-'} (mean {kept['mean_tool_calls'] or '-'})",
              (f"- Visual tokens: {kept['visual_tokens']} "
               f"(mean {kept['mean_visual_tokens'] or '-'}); "
              f"images: {kept['images']}"), "", "## Teacher usage", ""]
    usage = card["usage"]
    lines.append("- " + (", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in usage.items())
                         if usage else "not reported"))
    run = card["run"]
    lines.append(f"- This run drew {run['drawn']} samples in {run['seconds']} s"
                 + (f" ({run['samples_per_s']} samples/s)" if run.get("samples_per_s") else ""))
    return "\n".join(lines) + "\n"
