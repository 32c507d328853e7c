"""`pyvision model pretrain`: teach the tiny Qwen2.5-VL the skills a pretrained base brings.

The curriculum (:mod:`pipelines.models.curriculum`) is generated on the fly: example ``i`` of the
stream is a deterministic function of the seed and ``i``, so a run needs no data on disk and a
resumed run sees exactly the examples it would have seen. The loop is plain PyTorch on the
Hugging Face model (loss on the trained pieces only, AdamW with linear warm-up and cosine decay,
gradient clipping), because the model is small enough that one process on two CPU cores is the
right engine; the result is a standard Hugging Face folder that LLaMA-Factory, verl and vLLM load.

Progress is a bar; every ``log_every`` steps the loss (overall and per family), learning rate,
gradient norm and tokens per second go to the store under stage ``pretrain``; every
``save_every`` steps a checkpoint holds the weights, the optimizer and every RNG state, so
``--resume`` continues bit for bit. The finished model is written atomically with a manifest
(command, seed, steps, data, final loss, probe scores, sha256 of every file).
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pipelines.config.model import PretrainConfig
from pipelines.console import err
from pipelines.fsutil import atomic_dir, atomic_write_json
from pipelines.models.curriculum import make_example, stream_example
from pipelines.models.encoding import Encoder, collate, token_losses
from pipelines.models.tiny import shipped_base

PRETRAIN_VERSION = "1"
MANIFEST = "pretrain_manifest.json"


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio`` of it."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.min_lr_ratio
    return cfg.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def tokenizer_corpus(seed: int, n_examples: int = 4000) -> list[str]:
    """Text of the curriculum and of solver-style trajectories, for the tokenizer's merges."""
    from pipelines.models.curriculum import BASE_FAMILIES

    texts = [make_example(seed, fam, i).text for i in range(n_examples // len(BASE_FAMILIES))
             for fam in BASE_FAMILIES if fam != "image_text"]
    return texts + _solver_texts(seed)


def _solver_texts(seed: int, n: int = 120) -> list[str]:
    """What cold-start trajectories say (questions, solver code, closings) on tasks of a seed no
    recipe uses, so the tokenizer has merges for the demo's data without seeing it."""
    import random
    import tempfile

    from pipelines.data.solvers import plan, render_answer, render_turn
    from pipelines.data.synth import DEFAULT_FAMILIES, task_rng
    from pipelines.data.synth_image import make_image_task
    from pipelines.data.synth_video import make_video_task

    texts = []
    with tempfile.TemporaryDirectory(prefix="pyvision-tokcorpus-") as tmp:
        root = Path(tmp)
        (root / "media").mkdir()
        for kind, make in (("image-search", make_image_task), ("video", make_video_task)):
            fams = DEFAULT_FAMILIES[kind]
            for i in range(n):
                task = make(fams[i % len(fams)], task_rng(kind, 10_000 + seed, "tokenizer", i), i,
                            "tokenizer", root)
                p = plan(task, random.Random(i))
                texts.append(task.question + "\n" + "\n".join(render_turn(s) for s in p.steps)
                             + "\n" + render_answer(p))
    return texts


def build_random(size: str, seed: int) -> tuple[Any, Any]:
    """A randomly initialised tiny model and its processor (tokenizer trained on the curriculum)."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    from pipelines.models.tiny import SPECS, build_config, build_processor, train_tokenizer

    spec = SPECS[size]
    tokenizer = train_tokenizer(spec, seed, tokenizer_corpus(seed))
    config = build_config(spec, tokenizer)
    processor = build_processor(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.text_config.eos_token_id, config.text_config.bos_token_id],
        pad_token_id=config.text_config.pad_token_id, do_sample=False)
    return model, processor


def _save(model: Any, processor: Any, path: Path) -> None:
    model.save_pretrained(path)
    processor.save_pretrained(path)


def init_path(cfg: PretrainConfig) -> Path | None:
    """The folder a continued pretraining starts from (``model.pretrain.init``, ``~`` expanded)."""
    return Path(cfg.init).expanduser() if cfg.init else None


def check_init(cfg: PretrainConfig, out: Path | None = None) -> None:
    """``model.pretrain.init``, if set, is a loadable local model folder and not ``out``: a one-line
    error before anything is written, not a traceback once pretraining starts."""
    init = init_path(cfg)
    if init is None:
        return
    from pipelines.errors import UserError
    from pipelines.inputs import check_model

    if not init.is_dir():
        raise UserError(f"model.pretrain.init {cfg.init} is not a model folder",
                        hint="pass a local model folder, e.g. pipelines/models/weights/tiny-small")
    check_model(str(init), "model.pretrain.init")
    if out is not None and out.resolve() == init.resolve():
        raise UserError(f"model.pretrain.init and --out are the same folder ({out})",
                        hint="write the continued model elsewhere, then move it")


def init_record(path: Path) -> dict[str, Any]:
    """What continued pretraining started from: the folder, its files' sha256, its manifest."""
    manifest = path / MANIFEST
    return {"path": str(path), "sha256": file_digests(path),
            "manifest": json.loads(manifest.read_text()) if manifest.is_file() else None}


def file_digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.iterdir()) if p.is_file() and p.name != MANIFEST}


def pretrain(cfg: PretrainConfig, *, size: str, seed: int, out: Path, work: Path,
             store: Any = None, run_id: str | None = None, resume: bool = False,
             probe_n: int = 100, show_progress: bool = True) -> dict[str, Any]:
    """Pretrain a tiny model into ``out`` from random weights, or from ``cfg.init`` (continued
    pretraining); checkpoints live in ``work``."""
    import torch

    from pipelines.core.checkpoints import STATE_FILE, list_checkpoints, rng_state, set_rng_state

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ckpts = work / "checkpoints"
    found = list_checkpoints(ckpts) if resume else []
    latest = found[-1] if found else None
    init = init_path(cfg)
    if latest is not None or init is not None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        source = latest if latest is not None else init
        processor = AutoProcessor.from_pretrained(source)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    else:
        model, processor = build_random(size, seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start_step = 0
    if latest is not None:
        state = torch.load(latest / STATE_FILE, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        start_step = int(state["step"])
        if store is not None and run_id:
            store.delete_metrics_after(run_id, "pretrain", start_step - 1)
        err.print(f"resuming pretraining from {latest} (step {start_step})", markup=False)
    else:
        torch.manual_seed(seed)
    encode = Encoder(processor, cfg.max_tokens)
    pad_id = processor.tokenizer.pad_token_id
    mixture = dict(cfg.mixture)
    bar = _Bar(show_progress, cfg.steps, start_step)
    window: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    tokens = 0
    t_window = time.monotonic()
    last: dict[str, float] = {}
    try:
        for step in range(start_step, cfg.steps):
            batch = [encode(stream_example(seed, step * cfg.batch_size + i, mixture,
                                           cfg.induction_steps * cfg.batch_size,
                                           cfg.context_share))
                     for i in range(cfg.batch_size)]
            inputs = collate(batch, pad_id, model.config)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            losses, mask = token_losses(model, inputs)
            loss = losses.sum() / mask.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            optimizer.step()
            per_row = (losses.sum(1) / mask.sum(1).clamp(min=1)).tolist()
            for e, row_loss in zip(batch, per_row):
                window[e.family] += row_loss
                counts[e.family] += 1
            window["_all"] += loss.item()
            counts["_all"] += 1
            tokens += int(inputs["attention_mask"].sum())
            bar.update(step + 1, window["_all"] / counts["_all"])
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                elapsed = max(1e-9, time.monotonic() - t_window)
                last = {"loss": window["_all"] / counts["_all"], "lr": lr_at(step, cfg),
                        "grad_norm": norm, "tokens_per_s": tokens / elapsed,
                        **{f"loss/{f}": window[f] / counts[f] for f in counts if f != "_all"}}
                if store is not None and run_id:
                    store.log_metrics(run_id, "pretrain", step, last)
                window.clear()
                counts.clear()
                tokens = 0
                t_window = time.monotonic()
            if (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                _checkpoint(ckpts, step + 1, model, processor, optimizer, rng_state())
    finally:
        bar.close()
    model.eval()
    from pipelines.models.probe import probe_model

    scores = probe_model(model, processor, n=probe_n, seed=seed + 1)
    with atomic_dir(out, overwrite=True) as tmp:
        _save(model, processor, tmp)
        from pipelines.models.tiny import describe_module

        manifest = {
            "pretrain_version": PRETRAIN_VERSION, "size": size, "seed": seed,
            "command": "pyvision model pretrain " + " ".join(shlex.quote(a) for a in sys.argv[3:])
            if sys.argv[1:3] == ["model", "pretrain"] else None,
            "config": cfg.model_dump(mode="json"),
            "data": "generated on the fly: pipelines/models/curriculum.py, examples "
                    f"0..{cfg.steps * cfg.batch_size - 1} of seed {seed}",
            "init": init_record(init) if init is not None else None,
            "final_loss": last.get("loss"), "final_losses": {k: v for k, v in last.items()
                                                             if k.startswith("loss/")},
            "probe": scores, **describe_module(model),
            "torch_threads": torch.get_num_threads(),
        }
        manifest["sha256"] = file_digests(tmp)
        atomic_write_json(tmp / MANIFEST, manifest)
    return manifest


def _checkpoint(root: Path, step: int, model: Any, processor: Any, optimizer: Any,
                rng: dict[str, Any]) -> None:
    import shutil

    import torch

    from pipelines.core.checkpoints import STATE_FILE, list_checkpoints

    with atomic_dir(root / f"step_{step}", overwrite=True) as tmp:
        _save(model, processor, tmp)
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng},
                   tmp / STATE_FILE)
        (tmp / "step.json").write_text(json.dumps({"step": step}) + "\n")
    for old in list_checkpoints(root)[:-2]:
        shutil.rmtree(old, ignore_errors=True)


class _Bar:
    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.bar = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("pretrain"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                                TimeRemainingColumn(), console=err, transient=False)
            self.task = self.bar.add_task("pretrain", total=total, completed=start, loss="-")
            self.bar.start()

    def update(self, done: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, loss=f"{loss:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def copy_shipped_base(size: str, dest: Path) -> Path:
    """Copy the shipped base into ``dest`` after checking every file against its manifest."""
    import shutil

    from pipelines.errors import UserError

    src = shipped_base(size)
    manifest_path = src / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"no pretrained tiny base of size '{size}' in {src}",
                        hint=f"make it with `pyvision model pretrain --set model.tiny.size={size} "
                             f"--out {src}`, or use --set model.tiny.init=pretrain")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    digests = file_digests(src)
    bad = sorted(k for k, v in manifest["sha256"].items() if digests.get(k) != v)
    if bad:
        raise UserError(f"the shipped base {src} does not match its manifest ({', '.join(bad)})",
                        hint="restore it with `git checkout -- " + str(src) + "` (a Git LFS "
                             "pointer or a partial clone also looks like this)")
    with atomic_dir(dest, overwrite=True) as tmp:
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    return dest
