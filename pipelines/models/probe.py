"""`pyvision model probe`: what a base model can do before SFT, each skill as one number.

- ``copy``: a held-out span of random words, repeated exactly (greedy).
- ``colour_copy``: the colour a question names, written into code by a reply that does not name it
  (the first colour word of the generated code is the question's).
- ``readback``: after a code block and its printed output, the answer holds the last printed line in
  ``\\boxed{}`` (greedy).
- ``image_text``: for a held-out picture, its true caption is more likely than three captions that
  each change one object's colour or shape (chance: 0.25).
- ``lookup_far``: an options table after the video prompt's instructions (as the demo's prompts
  put it, about 200 tokens in), then "What is option X?": the reply starts with that option.
- ``table_copy``: the video prompt with an options question, then a reply opening a code block:
  the code's options table (``"A": (" red", ...)``) names every option, in order. The two last
  have no threshold: the shipped base, pretrained without contexts, scores 0.0 on both
  (``model.pretrain.context_share``).

Held-out means another seed of the same generators (:mod:`pipelines.models.curriculum`) than the
one the model was pretrained on. A randomly initialised model scores about 0 on the first three.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipelines.models.corpus import COLOURS, SHAPES
from pipelines.models.curriculum import (
    ASSISTANT,
    COLOUR_QUESTIONS,
    COLOUR_THINK,
    END,
    PICTURE_COLOURS,
    SHAPE_NAMES,
    SYSTEM,
    USER,
    Example,
    caption,
    example_rng,
    make_readback,
    option_lines,
    word_copy,
)

SKILLS = ("copy", "colour_copy", "readback", "image_text", "lookup_far", "table_copy")
# What the shipped base must reach (tests/pipelines/models/test_pretrain.py checks it). A random
# model scores about 0 on the first three and 0.25 (chance) on image_text; the shipped base scored
# 0.96 / 1.00 / 1.00 / 0.49 on 100 items each.
THRESHOLDS = {"copy": 0.9, "colour_copy": 0.9, "readback": 0.9, "image_text": 0.4}


def _generate(model: Any, processor: Any, prompts: list[list[int]], max_new: int,
              batch: int = 32) -> list[str]:
    import torch

    tok = processor.tokenizer
    pad = tok.pad_token_id
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), pad]
    out: list[str] = []
    for i in range(0, len(prompts), batch):
        part = prompts[i: i + batch]
        longest = max(len(p) for p in part)
        ids = torch.full((len(part), longest), pad, dtype=torch.long)
        attn = torch.zeros((len(part), longest), dtype=torch.long)
        for r, p in enumerate(part):
            ids[r, longest - len(p):] = torch.tensor(p)
            attn[r, longest - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad,
                                 use_cache=True)
        out += [tok.decode(row[longest:], skip_special_tokens=True) for row in gen]
    return out


def _ids(processor: Any, text: str) -> list[int]:
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _prefix_ids(processor: Any, ex: Example) -> list[int]:
    cut = next(i for i, (_, trained) in enumerate(ex.pieces) if trained)
    return _ids(processor, "".join(t for t, _ in ex.pieces[:cut]))


def probe_copy(model: Any, processor: Any, n: int, seed: int) -> float:
    examples = [word_copy(example_rng(seed, "probe-copy", i)) for i in range(n)]
    outs = _generate(model, processor, [_prefix_ids(processor, e) for e in examples], 64)
    spans = [e.target.replace("<|im_end|>", "").strip() for e in examples]
    return sum(o.strip().split("\n")[0].strip() == s for o, s in zip(outs, spans)) / n


def probe_colour_copy(model: Any, processor: Any, n: int, seed: int) -> float:
    prompts, colours = [], []
    for i in range(n):
        rng = example_rng(seed, "probe-colour", i)
        colour = rng.choice(COLOURS)
        q = rng.choice(COLOUR_QUESTIONS).format(c=colour, s=rng.choice(SHAPES))
        text = (f"{SYSTEM}{USER}Question: {q}{END}\n{ASSISTANT}{COLOUR_THINK}\n"
                "<code>\n```python\n")
        prompts.append(_ids(processor, text))
        colours.append(colour)
    outs = _generate(model, processor, prompts, 24)
    pattern = re.compile(r"\b(" + "|".join(COLOURS) + r")\b")
    hits = 0
    for out, colour in zip(outs, colours):
        m = pattern.search(out)
        hits += bool(m and m.group(1) == colour)
    return hits / n


def _options(rng: Any, k: int = 3) -> tuple[list[str], str]:
    options = rng.sample(COLOURS, k)
    return options, option_lines(options)


def _video_instructions() -> str:
    """The demo's video prompt up to its media line (what stands before a question)."""
    from pipelines.agent.prompts import load_template

    template, _ = load_template("video")
    return template.split("{media_info}")[0]


def probe_lookup_far(model: Any, processor: Any, n: int, seed: int) -> float:
    head = _video_instructions()
    prompts, wanted = [], []
    for i in range(n):
        options, lines = _options(example_rng(seed, "probe-lookup-far", i))
        k = i % len(options)
        prompts.append(_ids(processor, f"{SYSTEM}{USER}{head}{lines}\nWhat is option "
                                       f"{chr(65 + k)}?{END}\n{ASSISTANT}"))
        wanted.append(options[k])
    outs = _generate(model, processor, prompts, 6)
    return sum(o.strip().startswith(w) for o, w in zip(outs, wanted)) / n


TABLE_ENTRY = re.compile(r'"([A-D])": \(" ?([a-z]+)"')


def probe_table_copy(model: Any, processor: Any, n: int, seed: int) -> float:
    head = _video_instructions()
    prompts, wanted = [], []
    for i in range(n):
        options, lines = _options(example_rng(seed, "probe-table", i))
        question = (f"Question: Which object appears first in the video?\n{lines}\n"
                    "Answer with the option's letter from the given choices directly.\n")
        prompts.append(_ids(processor, f"{SYSTEM}{USER}{head}{question}{END}\n{ASSISTANT}"
                                       "I check every option's colour.\n<code>\n```python\n"))
        wanted.append(options)
    outs = _generate(model, processor, prompts, 64)
    hits = 0
    for out, options in zip(outs, wanted):
        table = dict(TABLE_ENTRY.findall(out))
        hits += all(table.get(chr(65 + i)) == o for i, o in enumerate(options))
    return hits / n


def probe_readback(model: Any, processor: Any, n: int, seed: int) -> float:
    examples = [make_readback(example_rng(seed, "probe-readback", i)) for i in range(n)]
    outs = _generate(model, processor, [_prefix_ids(processor, e) for e in examples], 48)
    hits = 0
    for out, ex in zip(outs, examples):
        want = re.search(r"\\boxed\{(.*)\}", ex.target)
        got = re.search(r"\\boxed\{(.*?)\}", out)
        hits += bool(want and got and got.group(1) == want.group(1))
    return hits / n


def _variants(objects: list[dict[str, Any]], rng: Any, k: int = 3) -> list[str]:
    true = caption(objects)
    out: list[str] = []
    for _ in range(50):
        if len(out) == k:
            break
        changed = [dict(o) for o in objects]
        o = rng.choice(changed)
        if rng.random() < 0.6:
            o["colour"] = rng.choice([c for c in PICTURE_COLOURS if c != o["colour"]])
        else:
            o["shape"] = rng.choice([s for s in SHAPE_NAMES if s != o["shape"]])
        text = caption(changed)
        if text != true and text not in out:
            out.append(text)
    return out


def probe_image_text(model: Any, processor: Any, n: int, seed: int) -> float:
    import torch

    from pipelines.models.curriculum import IMAGE, _picture, chat
    from pipelines.models.encoding import Encoder, collate, token_losses

    encode = Encoder(processor, 1024)
    hits = 0
    for i in range(n):
        rng = example_rng(seed, "probe-image", i)
        img, objects = _picture(rng)
        candidates = [caption(objects), *_variants(objects, rng)]
        batch = [encode(chat([(IMAGE, False), ("\nDescribe the picture.", False)], c, image=img))
                 for c in candidates]
        with torch.no_grad():
            losses, _ = token_losses(model, collate(batch, processor.tokenizer.pad_token_id, model.config))
        scores = losses.sum(1).tolist()  # summed negative log-likelihood of each caption
        hits += int(min(range(len(scores)), key=scores.__getitem__) == 0)
    return hits / n


def probe_model(model: Any, processor: Any, *, n: int = 100, seed: int = 1) -> dict[str, float]:
    """Every skill's score (0..1) on ``n`` held-out items each."""
    model.eval()
    return {"copy": probe_copy(model, processor, n, seed),
            "colour_copy": probe_colour_copy(model, processor, n, seed),
            "readback": probe_readback(model, processor, n, seed),
            "image_text": probe_image_text(model, processor, n, seed),
            "lookup_far": probe_lookup_far(model, processor, n, seed),
            "table_copy": probe_table_copy(model, processor, n, seed)}


def probe_path(path: str | Path, *, n: int = 100, seed: int = 1) -> dict[str, Any]:
    """Load a model folder and probe it."""
    import torch

    from pipelines.core.modeldir import load_vlm
    from pipelines.inputs import check_model

    check_model(str(path), "model")  # a missing folder is "not found", not a bad hub id
    model, processor = load_vlm(path, dtype=torch.float32, hint="pass a Hugging Face model "
                                "folder, e.g. pipelines/models/weights/tiny-small")
    scores = probe_model(model, processor, n=n, seed=seed)
    return {"model": str(path), "n": n, "seed": seed, "scores": scores,
            "thresholds": THRESHOLDS,
            "meets_thresholds": all(scores[k] >= v for k, v in THRESHOLDS.items())}
