"""The built-in text the tiny model's tokenizer is trained on.

Byte-level BPE covers any text whatever the corpus; the corpus only decides which merges exist,
so it should look like what the project feeds the model: agent prompts, the protocol's tags,
image/video analysis code, interpreter output and numbers. The data stage adds the generated
trajectories themselves (``extra_corpus``) so the merges fit the actual training data.
Generation is deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "cyan", "magenta", "white",
           "black", "gray", "pink", "brown"]
SHAPES = ["square", "circle", "triangle", "bar", "box", "object", "ball", "star"]
WORDS = ["cat", "tree", "car", "sign", "cup", "door", "bird", "lamp", "boat", "book"]

PROMPT_LINES = [
    ("You are an agent - please keep going until the user's query is completely resolved, before "
     "ending your turn and yielding back to the user."),
    "Only terminate your turn when you are sure that the problem is solved.",
    ("You MUST plan extensively before each function call, and reflect extensively on the "
     "outcomes of the previous function calls."),
    "The image is preloaded in the Python runtime as the PIL image `image_clue_0`.",
    "The video is preloaded in the Python runtime as `video_clue_0`, a decord VideoReader.",
    "You cannot see the video: sample frames with code and show them with plt.show().",
    "Use Python (numpy, PIL, matplotlib) to zoom in, crop, rotate, adjust contrast and measure.",
    "Show images with plt.show() and print values with print().",
    "Put your final answer in <answer>\n\\boxed{{}}\n</answer>.",
    "Answer with the option's letter from the given choices directly.",
    "Image Width: {w}; Image Height: {h}",
    "Frame Width: {w}; Frame Height: {h}; Video Length: {n}; Sample FPS: {fps}",
]

QUESTIONS = [
    "What is the colour of the small {shape}?",
    "How many {colour} objects are in the image?",
    "Is the {colour} object to the left or to the right of the {colour2} object?",
    "Is the {colour} object above or below the {colour2} object?",
    "How many pixels wide is the {colour} bar?",
    "What word is written in the {colour} box?",
    "How many {colour} objects are in the video?",
    "How many pixels does the {colour} object move between the first and the last frame?",
    "Which object appears first in the video?",
    "What is the material of the glove?",
]

CODE_SNIPPETS = [
    "import numpy as np\nfrom PIL import Image\nimport matplotlib.pyplot as plt\n",
    "arr = np.asarray(image_clue_0.convert(\"RGB\")).astype(int)\n",
    "print(image_clue_0.size)\n",
    "w, h = image_clue_0.size\nprint(w, h)\n",
    "crop = image_clue_0.crop(({x0}, {y0}, {x1}, {y1}))\nzoom = crop.resize((crop.width * 4, crop.height * 4))\n",
    "plt.imshow(zoom)\nplt.axis(\"off\")\nplt.show()\n",
    "target = np.array([{r}, {g}, {b}])\nmask = np.abs(arr - target).sum(axis=-1) < {tol}\n",
    "from scipy import ndimage\nlabels, n = ndimage.label(mask)\nprint(n)\n",
    "ys, xs = np.nonzero(mask)\nprint(xs.min(), xs.max(), ys.min(), ys.max())\n",
    "width = xs.max() - xs.min() + 1\nprint(width)\n",
    "cx = xs.mean()\ncy = ys.mean()\nprint(round(cx), round(cy))\n",
    "n = len(video_clue_0)\nfps = video_clue_0.get_avg_fps()\nprint(n, fps)\n",
    "idx = np.linspace(0, n - 1, {k}).astype(int)\nframes = video_clue_0.get_batch(idx).asnumpy()\n",
    "for i, frame in zip(idx, frames):\n    plt.imshow(frame)\n    plt.title(f\"frame {{i}}\")\n    plt.show()\n",
    "options = {{\"A\": \"{colour}\", \"B\": \"{colour2}\"}}\nprint(min(options, key=lambda k: first[options[k]]))\n",
    "first = {{}}\nfor i, frame in zip(idx, frames):\n    for name, rgb in colours.items():\n        if name not in first and (np.abs(frame.astype(int) - rgb).sum(-1) < 90).sum() > 20:\n            first[name] = i\n",
    "dist = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5\nprint(round(dist))\n",
    "print(\"left\" if cx1 < cx2 else \"right\")\n",
]

THOUGHTS = [
    "Let me look at the image first.", "I will zoom in on the region to see it clearly.",
    "The target is small, so I need to crop and enlarge it.",
    "I will build a colour mask and count the connected components.",
    "Now I can measure the width of the bar in pixels.",
    "I will sample a few frames from the video and look at them.",
    "The printed result gives the answer.", "The code output shows the value I need.",
    "So the answer is", "Therefore, the answer is",
]


def _fill(template: str, rng: random.Random) -> str:
    c1, c2 = rng.sample(COLOURS, 2)
    values = dict(shape=rng.choice(SHAPES), colour=c1, colour2=c2, word=rng.choice(WORDS),  # noqa: C408
                  w=rng.randint(64, 4096), h=rng.randint(64, 4096), n=rng.randint(8, 3000),
                  fps=f"{rng.uniform(1, 60):.2f}", x0=rng.randint(0, 900), y0=rng.randint(0, 700),
                  x1=rng.randint(100, 1000), y1=rng.randint(100, 800), r=rng.randint(0, 255),
                  g=rng.randint(0, 255), b=rng.randint(0, 255), tol=rng.choice([60, 90, 120]),
                  k=rng.choice([4, 8, 16]))
    return template.format(**values)


def _interpreter(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        body = str(rng.randint(0, 2000))
    elif kind < 0.6:
        body = f"{rng.randint(0, 999)} {rng.randint(0, 999)}"
    elif kind < 0.8:
        body = rng.choice(COLOURS + ["left", "right", "above", "below", "A", "B", "C", "D"])
    else:
        body = "Traceback (most recent call last):\nNameError: name 'x' is not defined"
    images = "".join("<image>" for _ in range(rng.randint(0, 2)))
    return f"<interpreter>\nText Result:\n{body}\nImage Result:\n{images}\n</interpreter>"


def builtin_corpus(seed: int = 0, n_docs: int = 3000) -> Iterator[str]:
    """Deterministic documents that look like the project's prompts, code and outputs."""
    rng = random.Random(seed)
    yield from PROMPT_LINES + QUESTIONS + THOUGHTS
    for _ in range(n_docs):
        parts = [_fill(rng.choice(PROMPT_LINES), rng), _fill(rng.choice(QUESTIONS), rng)]
        for _ in range(rng.randint(1, 3)):
            code = "".join(_fill(rng.choice(CODE_SNIPPETS), rng) for _ in range(rng.randint(1, 4)))
            parts.append(f"{rng.choice(THOUGHTS)}\n<code>\n```python\n{code}```\n</code>")
            parts.append(_interpreter(rng))
        answer = rng.choice([str(rng.randint(0, 500)), rng.choice(COLOURS), rng.choice("ABCD"),
                             rng.choice(["left", "right", "above", "below"]), rng.choice(WORDS)])
        parts.append(f"{rng.choice(THOUGHTS)} {answer}.\n<answer>\n\\boxed{{{answer}}}\n</answer>")
        yield "\n".join(parts)
    # Digits and short numbers appear everywhere in outputs; give them their own documents.
    yield " ".join(str(i) for i in range(1025))
    yield " ".join(f"{i / 10:.1f}" for i in range(200))


def prompt_template_texts() -> list[str]:
    """The agent's prompt template files, when present, so their phrasing gets merges."""
    root = Path(__file__).resolve().parent.parent / "agent" / "prompts"
    return [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.txt"))] if root.is_dir() else []
