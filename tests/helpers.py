"""Small data builders shared by several test modules."""

from __future__ import annotations

import json
from pathlib import Path


def make_sharegpt(root: Path, n: int = 8) -> tuple[str, str]:
    """A small PyVision-protocol SFT dataset in LLaMA-Factory's sharegpt layout."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = ["red", "green", "blue", "yellow"][i % 4]
        rgb = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
               "yellow": (230, 220, 30)}[colour]
        Image.new("RGB", (64, 48), rgb).save(root / f"img{i}.png")
        Image.new("RGB", (32, 32), rgb).save(root / f"zoom{i}.png")
        rows.append({"conversations": [
            {"from": "human", "value": "<image>What is the colour of the object?"},
            {"from": "gpt", "value": "I will zoom in.\n<code>\n```python\nplt.imshow(image_clue_0)\n"
                                     "plt.show()\n```\n</code>"},
            {"from": "human", "value": "<interpreter>\nText Result:\nNone\nImage Result:\n<image>"
                                       "\n</interpreter>"},
            {"from": "gpt", "value": f"It is {colour}.\n<answer>\n\\boxed{{{colour}}}\n</answer>"},
        ], "images": [f"img{i}.png", f"zoom{i}.png"]})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "dataset_info.json").write_text(json.dumps({"pyvision_sft": {
        "file_name": "train.jsonl", "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "images"}}}))
    return str(root), "pyvision_sft"
