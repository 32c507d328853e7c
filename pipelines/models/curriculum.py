"""The pretraining curriculum of the tiny base: what a pretrained Qwen2.5-VL brings to the method.

A real PyVision-RL run starts from a model that can already copy a span it has seen, look a value
up, read a printed result back, write simple Python and name what is in a picture. The tiny base
learns those skills here, before SFT, from examples the project generates itself. Each example is
a list of text pieces, each marked as trained or not (the loss falls on the trained ones only),
plus an optional image. Families:

- ``copy``: a span, then the same span again (the skill induction heads give). Some spans are
  random token ids (no prior helps, so only copying lowers the loss: the induction phase is all
  of these), the others random words, numbers and symbols, plain or as a chat request.
- ``lookup``: ``key = value`` lines (or an options table), then the value of one key, or the key of
  one value.
- ``readback``: a code block and its interpreter output, then an answer that repeats the last
  printed line in ``\\boxed{}``.
- ``colour_code``: a question naming a colour, then code that names the same colour (random RGB
  values: the palette itself is the SFT data's to teach).
- ``python``: the built-in corpus of agent-like prompts, code and outputs (trained everywhere).
- ``image_text``: a small picture of coloured shapes and a caption or a short answer about it
  (colour, shape, count, position), so the vision tower and the projector start aligned.
- ``table_code``: an options question, then code whose options table names every option in the
  solvers' form (``"A": (" red", (r, g, b))``, random RGB values). Not in the default mixture.

With ``context_share`` > 0, that share of the text examples of ``CONTEXT_FAMILIES`` start after a
context (instruction lines, spans of words, Python), as a real prompt puts its options a few
hundred tokens after its start. The shipped base, pretrained without it, looks an option up when
the options open the prompt and not behind the video prompt's instructions (`pyvision model
probe`'s ``lookup_far``, 0.0).

Every example is a deterministic function of ``(seed, family, index)``; the mixture picks the
family of example ``i`` from the same hash, so a run is the same whatever the batch size.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelines.data.solvers import options_entries
from pipelines.models.corpus import COLOURS, PROMPT_LINES, SHAPES, WORDS, builtin_corpus

# Pieces of a chat, rendered exactly as the Qwen2-VL chat template renders them.
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
USER = "<|im_start|>user\n"
ASSISTANT = "<|im_start|>assistant\n"
END = "<|im_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"

# The families of the shipped base's stream; its tokenizer was trained on their text, so a new family
# joins FAMILIES only (a new tokenizer corpus would change every merge).
BASE_FAMILIES = ("copy", "lookup", "readback", "colour_code", "python", "image_text")
FAMILIES = (*BASE_FAMILIES, "table_code")
CONTEXT_FAMILIES = ("copy", "lookup", "colour_code", "table_code")
DEFAULT_MIXTURE = {"copy": 0.2, "lookup": 0.15, "readback": 0.15, "colour_code": 0.15,
                   "python": 0.1, "image_text": 0.25}

LEXICON = sorted(set(COLOURS + SHAPES + WORDS + [
    "left", "right", "above", "below", "first", "last", "frame", "mask", "arr", "image", "crop",
    "zoom", "count", "width", "height", "value", "print", "answer", "result", "object", "video",
    "the", "a", "of", "and", "is", "in", "to", "how", "many", "what", "which", "where", "not",
    "x", "y", "n", "k", "i", "j", "A", "B", "C", "D", "E", "True", "False", "None", "np", "plt",
    "sun", "key", "map", "pen", "fish", "moon", "ship", "apple", "river", "stone", "cloud",
    "green", "orange", "violet", "silver", "gold", "north", "south", "east", "west"]))
SYMBOLS = ["(", ")", "[", "]", ",", ".", ":", "=", "+", "-", "*", "/", "_", "'", '"', "#"]
SHAPE_NAMES = ("square", "circle", "triangle")
# Colours of the pictures: distinct at a glance even after the processor's downscaling.
PICTURE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (235, 205, 30), "purple": (150, 60, 190), "cyan": (40, 200, 210),
    "orange": (240, 140, 20), "black": (20, 20, 20), "white": (250, 250, 250)}
PICTURE_SIZE = 112  # 4 x 4 visual tokens


Piece = tuple[str | tuple[int, ...], bool]


@dataclass(frozen=True)
class Example:
    family: str
    pieces: tuple[Piece, ...]
    """(content, trained) in order. Content is text, or a tuple of random draws in [0, 2**31)
    that the encoder maps onto the tokenizer's regular (non-special) token ids, so spans of
    random tokens stay independent of the tokenizer."""
    image: Any = field(default=None, compare=False)
    """A PIL image for the single ``<|image_pad|>`` in the text, or None."""

    @property
    def text(self) -> str:
        """The text pieces joined (random-token pieces have no text)."""
        return "".join(t for t, _ in self.pieces if isinstance(t, str))

    @property
    def target(self) -> str:
        """The trained text (what a probe asks the model to produce)."""
        return "".join(t for t, trained in self.pieces if trained and isinstance(t, str))


def example_rng(seed: int, family: str, index: int) -> random.Random:
    digest = hashlib.sha256(f"pyvision-pretrain:{seed}:{family}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def family_of(seed: int, index: int, mixture: dict[str, float]) -> str:
    """The family of example ``index`` of the stream: a deterministic draw from the mixture."""
    u = example_rng(seed, "mixture", index).random() * sum(mixture.values())
    for name, weight in mixture.items():
        u -= weight
        if u < 0:
            return name
    return next(reversed(mixture))


def chat(user: Sequence[tuple[str, bool]], answer: str, image: Any = None,
         family: str = "") -> Example:
    """A one-turn chat whose assistant reply (and its end token) is trained."""
    pieces = [(SYSTEM + USER, False), *user, (END + "\n" + ASSISTANT, False), (answer, True),
              (END, True), ("\n", False)]
    return Example(family, tuple(pieces), image)


def _span(rng: random.Random, lo: int = 4, hi: int = 24) -> str:
    n = rng.randint(lo, hi)
    style = rng.random()
    if style < 0.6:
        return " ".join(rng.choice(LEXICON) for _ in range(n))
    if style < 0.8:
        return " ".join(str(rng.randint(0, 999)) if rng.random() < 0.5 else rng.choice(LEXICON)
                        for _ in range(n))
    return "".join(rng.choice(LEXICON) if rng.random() < 0.6 else rng.choice(SYMBOLS)
                   for _ in range(n))


def random_token_copy(rng: random.Random, lo: int = 8, hi: int = 32,
                      repeats: int = 2) -> Example:
    """Random token ids, then, ``repeats`` times, a newline and the same ids again (trained).
    With no prior to lean on, the loss falls only once the model copies by content: measured on
    the small model (batch 32, AdamW 1e-3, spans of 8-32 tokens repeated twice), next-token
    accuracy on the repeats went 0.13 -> 0.95 between steps 300 and 700, where one repeat of
    word spans left it on a unigram plateau for 1000 steps. (Spans of one fixed length are
    copied within 150 steps, but by position, which does not transfer.)"""
    span = tuple(rng.getrandbits(31) for _ in range(rng.randint(lo, hi)))
    pieces: list[Piece] = [(span, False)]
    for _ in range(repeats):
        pieces += [("\n", False), (span, True)]
    return Example("copy", (*pieces, ("\n", True)))


def make_copy(rng: random.Random) -> Example:
    if rng.random() < 0.3:
        return random_token_copy(rng)
    return word_copy(rng)


def word_copy(rng: random.Random) -> Example:
    """A span of words, numbers and symbols repeated after a separator or on request."""
    span = _span(rng)
    if rng.random() < 0.5:
        sep = rng.choice([" | ", "\n", " => ", "\nagain: "])
        return Example("copy", ((span, False), (sep, False), (span, True), ("\n", True)))
    ask = rng.choice(["Repeat exactly:\n", "Copy this text:\n", "Say it again:\n"])
    return chat([(ask + span, False)], span, family="copy")


def context(rng: random.Random, seed: int) -> str:
    """What a real prompt puts before the part a reply needs: instruction lines, spans of words,
    Python; 1-8 parts, up to a few hundred tokens."""
    parts = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.4:
            parts.append(rng.choice(PROMPT_LINES).format(
                w=rng.randint(64, 2048), h=rng.randint(64, 2048), n=rng.randint(8, 64), fps=8))
        elif kind < 0.7:
            parts.append(_span(rng, 4, 30))
        else:
            parts.append(rng.choice(_python_docs(seed))[:rng.randint(40, 300)])
    return "\n".join(parts) + "\n"


def behind_context(ex: Example, rng: random.Random, seed: int) -> Example:
    """``ex`` with a context before its text: after the chat's opening, else first."""
    head, trained = ex.pieces[0]
    if isinstance(head, str) and not trained and head.endswith(USER):
        pieces = ((head + context(rng, seed), False), *ex.pieces[1:])
    else:
        pieces = ((context(rng, seed), False), *ex.pieces)
    return Example(ex.family, pieces, ex.image)


def option_lines(options: Sequence[str]) -> str:
    """A multiple-choice question's options as the synthetic tasks print them: ``(A) red``."""
    return "\n".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))


def _value(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return str(rng.randint(0, 2000))
    if kind < 0.55:
        return rng.choice(COLOURS)
    if kind < 0.7:
        return rng.choice("ABCDE")
    if kind < 0.85:
        return rng.choice(["left", "right", "above", "below", "True", "False"])
    return rng.choice(WORDS + SHAPES)


def make_lookup(rng: random.Random) -> Example:
    if rng.random() < 0.5:
        names = rng.sample([w for w in LEXICON if w.isidentifier() and len(w) > 1], rng.randint(2, 6))
        values = [_value(rng) for _ in names]
        table = "".join(f"{k} = {v!r}\n" if not v.isdigit() else f"{k} = {v}\n"
                        for k, v in zip(names, values))
        q = rng.randrange(len(names))
        return chat([(f"{table}What is {names[q]}?", False)], values[q], family="lookup")
    # An options table, asked both ways: the colour of a letter, or the letter of a colour.
    options = rng.sample(COLOURS, rng.randint(2, 5))
    letters = [chr(65 + i) for i in range(len(options))]
    lines = option_lines(options)
    q = rng.randrange(len(options))
    if rng.random() < 0.5:
        return chat([(f"{lines}\nWhich letter is {options[q]}?", False)], letters[q],
                    family="lookup")
    return chat([(f"{lines}\nWhat is option {letters[q]}?", False)], options[q], family="lookup")


def make_readback(rng: random.Random) -> Example:
    value = _value(rng)
    noise = [str(rng.randint(0, 999)) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.3:
        noise.append("{" + ", ".join(f"'{c}': {rng.randint(0, 30)}"
                                     for c in rng.sample(COLOURS, 2)) + "}")
    printed = "\n".join([*noise, value])
    var = rng.choice(["n", "result", "answer", "best", "x", "count"])
    code = f"{var} = compute()\nprint({var})"
    think = rng.choice(["I run the code.", "Let me compute it.", "I measure it with code."])
    turn = f"{think}\n<code>\n```python\n{code}\n```\n</code>"
    closing = rng.choice(["The code printed {v}, so the answer is {v}.", "The result is {v}.",
                          "From the output, the answer is {v}."]).format(v=value)
    answer = f"{closing}\n<answer>\n\\boxed{{{value}}}\n</answer>"
    pieces = [(SYSTEM + USER + "Question: what does the code give?" + END + "\n" + ASSISTANT, False),
              (turn, False), (END + "\n" + USER, False),
              (f"<interpreter>\nText Result:\n{printed}\n</interpreter>", False),
              (END + "\n" + ASSISTANT, False), (answer, True), (END, True), ("\n", False)]
    return Example("readback", tuple(pieces))


# A reasoning line that does not name the colour: the code must copy it from the question.
COLOUR_THINK = "I find the pixels of that colour."
COLOUR_QUESTIONS = [
    "How many {c} objects are in the image?", "How many {c} objects are in the video?",
    "Where is the {c} {s}?", "How wide is the {c} bar?", "Is there a {c} {s} in the picture?",
    "Count the {c} shapes.", "Find the {c} {s} and measure it.",
]


def make_colour_code(rng: random.Random) -> Example:
    colour = rng.choice(COLOURS)
    others = rng.sample([c for c in COLOURS if c != colour], rng.randint(0, 2))
    q = rng.choice(COLOUR_QUESTIONS).format(c=colour, s=rng.choice(SHAPES))
    if others and rng.random() < 0.5:
        q += " Ignore the " + " and ".join(others) + " ones."
    rgb = tuple(rng.randint(0, 255) for _ in range(3))
    arr, mask = rng.choice([("a", "m"), ("arr", "mask"), ("frame", "hit")])
    tol = rng.choice([40, 60, 90])
    body = rng.choice([
        f"{colour} = {rgb}\n{mask} = np.abs({arr} - {colour}).sum(-1) < {tol}\nprint({mask}.sum())",
        (f"target = {rgb}  # {colour}\n{mask} = np.abs({arr} - target).sum(-1) < {tol}\n"
        f"print('{colour}', {mask}.sum())"),
        (f"colours = {{'{colour}': {rgb}}}\n{mask} = np.abs({arr} - colours['{colour}']).sum(-1) < {tol}\n"
        f"print({mask}.sum())"),
    ])
    think = rng.choice([f"I look for the {colour} pixels.", f"I mask the {colour} colour.",
                        COLOUR_THINK, "I mask that colour and count."])
    answer = f"{think}\n<code>\n```python\n{body}\n```\n</code>"
    return chat([(f"Question: {q}", False)], answer, family="colour_code")


TABLE_QUESTIONS = [
    "Which object appears first in the video?", "Which object appears last in the video?",
    "Which colour is the largest shape?", "Which object is in the image?",
    "Which bar is the widest?", "Which colour covers the most pixels?",
]


def make_table_code(rng: random.Random) -> Example:
    """An options question, then code that opens with the options table in the solvers' form:
    every option's name copied, in order (random RGB values: the palette is the SFT data's)."""
    options = rng.sample(COLOURS, rng.randint(2, 4))
    q = (f"Question: {rng.choice(TABLE_QUESTIONS)}\n{option_lines(options)}\n"
         "Answer with the option's letter from the given choices directly.")
    table = options_entries(options, lambda _: (rng.randint(0, 255), rng.randint(0, 255),
                                                rng.randint(0, 255)))
    think = rng.choice(["I check every option's colour.", "For each option I find its pixels.",
                        "I mask each option's colour."])
    answer = f"{think}\n<code>\n```python\noptions = {{{table}}}\n"
    return chat([(q, False)], answer, family="table_code")


_PYTHON_DOCS: dict[int, list[str]] = {}


def _python_docs(seed: int) -> list[str]:
    if seed not in _PYTHON_DOCS:
        _PYTHON_DOCS[seed] = list(builtin_corpus(seed + 7919, 2000))
    return _PYTHON_DOCS[seed]


def make_python(rng: random.Random, seed: int) -> Example:
    doc = rng.choice(_python_docs(seed))
    return Example("python", ((doc[:1200], True),))


def _picture(rng: random.Random) -> tuple[Any, list[dict[str, Any]]]:
    from PIL import Image, ImageDraw

    grey = rng.randint(110, 150)
    img = Image.new("RGB", (PICTURE_SIZE, PICTURE_SIZE), (grey, grey, grey))
    draw = ImageDraw.Draw(img)
    objects: list[dict[str, Any]] = []
    boxes: list[tuple[int, int, int, int]] = []
    for _ in range(rng.randint(1, 4)):
        for _try in range(50):
            s = rng.randint(18, 30)
            x, y = rng.randint(2, PICTURE_SIZE - s - 2), rng.randint(2, PICTURE_SIZE - s - 2)
            box = (x, y, x + s, y + s)
            if all(box[2] + 4 <= b[0] or b[2] + 4 <= box[0] or box[3] + 4 <= b[1]
                   or b[3] + 4 <= box[1] for b in boxes):
                break
        else:
            continue
        boxes.append(box)
        colour = rng.choice(list(PICTURE_COLOURS))
        kind = rng.choice(SHAPE_NAMES)
        fill = PICTURE_COLOURS[colour]
        if kind == "square":
            draw.rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=fill)
        elif kind == "circle":
            draw.ellipse((box[0], box[1], box[2] - 1, box[3] - 1), fill=fill)
        else:
            draw.polygon([((box[0] + box[2]) // 2, box[1]), (box[2] - 1, box[3] - 1),
                          (box[0], box[3] - 1)], fill=fill)
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        where = ("top" if cy < PICTURE_SIZE / 2 else "bottom") + " " + \
            ("left" if cx < PICTURE_SIZE / 2 else "right")
        objects.append({"colour": colour, "shape": kind, "where": where})
    return img, objects


def caption(objects: list[dict[str, Any]]) -> str:
    """A caption naming every object: ``a red circle at the top left, a blue square at ...``."""
    return ", ".join(f"a {o['colour']} {o['shape']} at the {o['where']}" for o in objects) + "."


def make_image_text(rng: random.Random) -> Example:
    img, objects = _picture(rng)
    kind = rng.random()
    target = rng.choice(objects)
    if kind < 0.4:
        q, a = "Describe the picture.", caption(objects)
    elif kind < 0.6:
        n = sum(o["colour"] == target["colour"] for o in objects)
        q, a = f"How many {target['colour']} objects are there?", str(n)
    elif kind < 0.8:
        q, a = f"What colour is the {target['shape']} at the {target['where']}?", target["colour"]
    else:
        q, a = f"Where is the {target['colour']} {target['shape']}?", target["where"]
    return chat([(IMAGE, False), ("\n" + q, False)], a, image=img, family="image_text")


def make_example(seed: int, family: str, index: int, context_share: float = 0.0) -> Example:
    """Example ``index`` of ``family``; with ``context_share``, that share of the text examples of
    CONTEXT_FAMILIES start after a context (drawn from a stream of its own, so at 0 every example
    is the one the shipped base was pretrained on)."""
    ex = _make(seed, family, index)
    if context_share and family in CONTEXT_FAMILIES and ex.image is None:
        rng = example_rng(seed, "context", index)
        if rng.random() < context_share:
            ex = behind_context(ex, rng, seed)
    return ex


def _make(seed: int, family: str, index: int) -> Example:
    rng = example_rng(seed, family, index)
    if family == "copy":
        return make_copy(rng)
    if family == "lookup":
        return make_lookup(rng)
    if family == "readback":
        return make_readback(rng)
    if family == "colour_code":
        return make_colour_code(rng)
    if family == "python":
        return make_python(rng, seed)
    if family == "image_text":
        return make_image_text(rng)
    if family == "table_code":
        return make_table_code(rng)
    raise ValueError(f"unknown pretraining family '{family}'")


def stream_example(seed: int, index: int, mixture: dict[str, float],
                   induction: int = 0, context_share: float = 0.0) -> Example:
    """Example ``index`` of the training stream; the first ``induction`` are random-token copies."""
    if index < induction:
        return random_token_copy(example_rng(seed, "induction", index))
    return make_example(seed, family_of(seed, index, mixture), index, context_share)
