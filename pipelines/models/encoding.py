"""Curriculum examples as model inputs: token ids with their labels, right-padded batches, and
the per-token loss on the trained pieces.

Pretraining minimises that loss (:mod:`pipelines.models.pretrain`) and the probe compares caption
likelihoods with it (:mod:`pipelines.models.probe`); both import it from here, so neither imports
the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.models.curriculum import IMAGE, Example


@dataclass
class Encoded:
    family: str
    ids: list[int]
    labels: list[int]  # -100 where no loss
    pixel_values: Any = None
    grid: Any = None


class Encoder:
    """Turns curriculum examples into token ids and labels with one processor."""

    def __init__(self, processor: Any, max_tokens: int) -> None:
        self.processor = processor
        self.tok = processor.tokenizer
        self.max_tokens = max_tokens
        self.image_pad = self.tok.convert_tokens_to_ids("<|image_pad|>")
        self.merge = getattr(processor.image_processor, "merge_size", 2)
        special = set(self.tok.all_special_ids)
        self.regular = [i for i in range(len(self.tok)) if i not in special]

    def __call__(self, ex: Example) -> Encoded:
        ids: list[int] = []
        labels: list[int] = []
        pixel_values = grid = None
        for text, trained in ex.pieces:
            if not isinstance(text, str):
                part = [self.regular[r % len(self.regular)] for r in text]
            elif IMAGE in text:
                vision = self.processor.image_processor(images=[ex.image], return_tensors="pt")
                pixel_values, grid = vision["pixel_values"], vision["image_grid_thw"]
                n = int(grid.prod()) // (self.merge ** 2)
                before, after = text.split(IMAGE, 1)
                part = (self.tok(before, add_special_tokens=False)["input_ids"]
                        + self.tok("<|vision_start|>", add_special_tokens=False)["input_ids"]
                        + [self.image_pad] * n
                        + self.tok("<|vision_end|>" + after, add_special_tokens=False)["input_ids"])
            else:
                part = self.tok(text, add_special_tokens=False)["input_ids"]
            ids += part
            labels += part if trained else [-100] * len(part)
        if len(ids) > self.max_tokens and pixel_values is None:
            ids, labels = ids[: self.max_tokens], labels[: self.max_tokens]
        return Encoded(ex.family, ids, labels, pixel_values, grid)

    def prefix(self, ex: Example) -> tuple[list[int], Any, Any]:
        """The ids before the first trained piece (what a probe prompts with)."""
        cut = next(i for i, (_, trained) in enumerate(ex.pieces) if trained)
        enc = self(Example(ex.family, ex.pieces[:cut] + (("", True),), ex.image))
        return enc.ids, enc.pixel_values, enc.grid


def collate(batch: list[Encoded], pad_id: int, config: Any) -> dict[str, Any]:
    """A right-padded batch; with images, the token types that give them 3-D positions."""
    import torch

    from pipelines.agent.policies.tokens import mm_token_type_ids

    longest = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        attn[i, : len(e.ids)] = 1
    out: dict[str, Any] = {"input_ids": ids, "labels": labels, "attention_mask": attn}
    pix = [e.pixel_values for e in batch if e.pixel_values is not None]
    if pix:
        out["pixel_values"] = torch.cat(pix)
        out["image_grid_thw"] = torch.cat([e.grid for e in batch if e.grid is not None])
        out["mm_token_type_ids"] = mm_token_type_ids(ids, config)
    return out


def token_losses(model: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
    """Per-token cross-entropy ``[B, T-1]`` and its mask (1 where a label is trained)."""
    import torch

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    mask = (targets != -100).float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.clamp(min=0).reshape(-1),
        reduction="none").view(targets.shape)
    return loss * mask, mask
