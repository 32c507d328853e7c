"""Programmatic solvers: the Python a good agent writes for each synthetic family.

``plan(task, rng)`` returns the steps (a thought and a code block each), a closing thought and the
answer. The code uses only what the question says (colour names, options) and the media in the
runtime (``image_clue_0`` / ``video_clue_0``); it never reads the generator's hidden coordinates.
The last line printed by the last step is exactly the answer (a colour, an integer or an option
letter), so a model that learns the behaviour learns to copy the result into ``\\boxed{}``.

Code and reasoning vary (two spellings of the image code, paraphrased thoughts, an optional first
look at the whole image or a few frames) so that a model learns the behaviour rather than one
string, but stay short: the embedded demo teaches them to a tiny model. Code for a video opens by
reading the video, so no video family's code starts like an image family's.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipelines.core.records import Task
from pipelines.data.vocab import PALETTE


@dataclass(frozen=True)
class Step:
    thought: str
    code: str


@dataclass(frozen=True)
class SolverPlan:
    steps: list[Step]
    final_thought: str
    answer: str


def _rgb(colour: str) -> str:
    r, g, b = PALETTE[colour]
    return f"({r}, {g}, {b})"


def _consts(*colours: str) -> str:
    """Named colour constants (``cyan = (40, 200, 210)``), as a person writes them: the value then
    follows its name, which a small model learns far more easily than a triple whose colour was
    named a few lines earlier."""
    return "".join(f"{c} = {_rgb(c)}\n" for c in dict.fromkeys(colours))


def _options(task: Task) -> dict[str, str]:
    return {chr(65 + i): o for i, o in enumerate(task.options)}


def _named_options(task: Task) -> str:
    """The options table of a colour choice, each option's name then its value
    (``"A": (" cyan", (40, 200, 210))``): the name is copied from the question's option line of the
    same letter, and the value follows the name it belongs to. The name keeps its leading space so
    that it is the question's own token (`` cyan``, as in ``(A) cyan``); ``("cyan"`` would split
    into ``("`` and ``cyan``, a token the question never shows."""
    return options_entries(task.options, _rgb)


def options_entries(options: Sequence[str], rgb: Callable[[str], tuple[int, int, int]]) -> str:
    """``"A": (" cyan", (40, 200, 210)), ...``: each option's letter, its name (with the leading
    space of the question's own token) and ``rgb(name)``. The pretraining curriculum writes the
    same tables with random values."""
    return ", ".join(f'"{chr(65 + i)}": (" {c}", {rgb(c)})' for i, c in enumerate(options))


def _colour_in(question: str) -> str:
    for name in PALETTE:
        if re.search(rf"\b{name}\b", question):
            return name
    raise ValueError(f"no palette colour in question: {question!r}")


def _two_colours(question: str) -> tuple[str, str]:
    found = sorted((question.index(n), n) for n in PALETTE if re.search(rf"\b{n}\b", question))
    return found[0][1], found[1][1]


LOOK_IMAGE = [
    Step("Let me look at the whole image first.", "plt.imshow(image_clue_0)\nplt.show()"),
    Step("First I check the image size and take a look.",
         "print(image_clue_0.size)\nplt.imshow(image_clue_0)\nplt.show()"),
]
LOOK_VIDEO = [
    Step("I cannot see the video, so I sample a few frames first.",
         "idx = np.linspace(0, len(video_clue_0) - 1, 4).astype(int)\n"
         "for f in video_clue_0.get_batch(idx).asnumpy():\n    plt.imshow(f)\n    plt.show()"),
    Step("Let me look at the middle frame of the video.",
         "n = len(video_clue_0)\nprint(n)\nplt.imshow(video_clue_0[n // 2].asnumpy())\nplt.show()"),
]
CLOSING = [
    "The code printed {answer}, so the answer is {answer}.",
    "From the output, the answer is {answer}.",
    "The result is {answer}.",
]
# Two spellings of the image code, so the model learns the behaviour rather than one string.
NAMES = [("a", "m"), ("arr", "mask")]


def _image_steps(task: Task, rng: random.Random) -> list[Step]:
    fam = task.metadata["family"]
    q = task.question
    a, m = rng.choice(NAMES)
    load = f"{a} = np.asarray(image_clue_0).astype(int)\n"
    if fam == "color":
        if task.answer_type == "choice":
            table, value = _named_options(task), "options[k][1]"
        else:
            table, value = ", ".join(f'"{c}": {_rgb(c)}' for c in PALETTE), "options[k]"
        code = (load + f"{m} = ({a}.max(-1) - {a}.min(-1)) > 80\nrgb = {a}[{m}].mean(0)\n"
                f"options = {{{table}}}\n"
                f"print(min(options, key=lambda k: np.abs(rgb - {value}).sum()))")
        thought = rng.choice([("Everything but the target is grey, so I take the mean colour of the "
                               "saturated pixels and compare it with the options."),
                              "I find the coloured pixels and match their mean colour."])
        return [Step(thought, code)]
    if fam == "count":
        colour = _colour_in(q)
        code = (f"from scipy import ndimage\n{_consts(colour)}{load}"
                f"{m} = np.abs({a} - {colour}).sum(-1) < 60\nprint(ndimage.label({m})[1])")
        thought = rng.choice([f"I mask the {colour} pixels and count the connected blobs.",
                              f"Counting the {colour} objects: mask the colour, then label the blobs."])
        return [Step(thought, code)]
    if fam == "position":
        c1, c2 = _two_colours(q)
        axis, (lo, hi) = (1, ("left", "right")) if "left" in q else (0, ("above", "below"))
        table = ", ".join(f'"{k}": "{o}"' for k, o in _options(task).items())
        code = (_consts(c1, c2) + load +
                f"p = np.nonzero(np.abs({a} - {c1}).sum(-1) < 60)[{axis}].mean()\n"
                f"q = np.nonzero(np.abs({a} - {c2}).sum(-1) < 60)[{axis}].mean()\n"
                f"print(p, q)\noptions = {{{table}}}\n"
                f"print([k for k in options if options[k] == (\"{lo}\" if p < q else \"{hi}\")][0])")
        thought = rng.choice([(f"I locate the {c1} and the {c2} objects by colour and compare "
                               "their positions."),
                              "I find both objects by colour and compare their centres."])
        return [Step(thought, code)]
    if fam == "measure":
        colour = _colour_in(q)
        code = (_consts(colour) + load + f"xs = np.nonzero(np.abs({a} - {colour}).sum(-1) < 60)[1]\n"
                "print(xs.max() - xs.min() + 1)")
        thought = rng.choice([f"I mask the {colour} pixels and measure the bar's extent in x.",
                              "The width is the number of columns the bar covers."])
        return [Step(thought, code)]
    if fam == "text":
        colour = _colour_in(q)
        code = (_consts(colour) + load + f"ys, xs = np.nonzero(np.abs({a} - {colour}).sum(-1) < 60)\n"
                "box = image_clue_0.crop((xs.min() - 4, ys.min() - 4, xs.max() + 4, ys.max() + 4))\n"
                "plt.imshow(box.resize((box.width * 6, box.height * 6)))\nplt.show()")
        return [Step(f"The {colour} box is tiny; I will find it and zoom in to read the word.", code)]
    raise ValueError(f"no solver for image family {fam}")


def _video_steps(task: Task, rng: random.Random) -> list[Step]:
    fam = task.metadata["family"]
    q = task.question
    # Video code opens by reading the video, before any line it shares with an image family's code,
    # and spells its names one way. Counting once opened like the image's counting (``from scipy
    # import ndimage``, the colour constant): RL that reinforced the image's next line
    # (``np.asarray(image_clue_0)``) wrote it into the video's counting code too, and seed 2's RL
    # fell behind its SFT model on video (docs/tiny-recipe.md).
    f, m = "frame", "mask"
    if fam == "count":
        colour = _colour_in(q)
        code = (f"{f} = video_clue_0[len(video_clue_0) // 2].asnumpy().astype(int)\n"
                f"from scipy import ndimage\n{_consts(colour)}"
                f"{m} = np.abs({f} - {colour}).sum(-1) < 90\nprint(ndimage.label({m})[1])")
        thought = rng.choice([f"Every object stays in view, so I count the {colour} blobs in one frame.",
                              f"I count the {colour} objects in the middle frame."])
        return [Step(thought, code)]
    if fam == "distance":
        colour = _colour_in(q)
        code = (f"last = len(video_clue_0) - 1\n{_consts(colour)}"
                f"def x(i):\n    {f} = video_clue_0[i].asnumpy().astype(int)\n"
                f"    return np.nonzero(np.abs({f} - {colour}).sum(-1) < 90)[1].mean()\n"
                "print(round(abs(x(last) - x(0))))")
        thought = rng.choice([(f"I locate the {colour} object in the first and the last frame and "
                               "measure how far it moved."),
                              ("The distance is between the object's positions in the first and "
                               "last frames.")])
        return [Step(thought, code)]
    if fam == "order":
        code = (f"options = {{{_named_options(task)}}}\n"
                "frames = video_clue_0.get_batch(range(len(video_clue_0))).asnumpy().astype(int)\n"
                "first = {k: int(np.argmax([(np.abs(x - c).sum(-1) < 90).sum() > 20 for x in frames])) "
                "for k, (name, c) in options.items()}\nprint(first)\nprint(min(first, key=first.get))")
        thought = rng.choice(["For each option's colour I find the first frame where it is visible.",
                              "I check every frame for each colour and take the earliest."])
        return [Step(thought, code)]
    raise ValueError(f"no solver for video family {fam}")


def plan(task: Task, rng: random.Random) -> SolverPlan:
    """How a good agent solves ``task`` (one or two looks, then a measurement)."""
    steps = _video_steps(task, rng) if task.video else _image_steps(task, rng)
    if rng.random() < 0.5 and task.metadata.get("family") != "text":
        steps = [rng.choice(LOOK_VIDEO if task.video else LOOK_IMAGE)] + steps
    # Every step restates what it is asked, as careful agents do; the words its code then needs
    # (a colour, the kind of question) are copied from its own recent text. Restated on the first
    # step only, a measurement that followed a first look had the question behind the frames and
    # an interpreter turn, and the one-epoch SFT model of seed 1 wrote the wrong family's code
    # there: counting code for 59 of 64 order questions and for all 23 colour choices it looked at
    # first (docs/tiny-recipe.md).
    asked = task.question.strip().splitlines()[0]
    steps = [Step(f"The question: {asked}\n{s.thought}", s.code) for s in steps]
    answer = task.metadata.get("word") if task.metadata.get("family") == "text" else task.answer
    closing = rng.choice(CLOSING).format(answer=answer)
    if task.metadata.get("family") == "text":
        closing = f"The zoomed box reads '{answer}'. The answer is {answer}."
    return SolverPlan(steps=steps, final_thought=closing, answer=str(answer))


def render_turn(step: Step) -> str:
    """One assistant turn in the protocol."""
    return f"{step.thought}\n<code>\n```python\n{step.code}\n```\n</code>"


def render_answer(plan_: SolverPlan) -> str:
    return f"{plan_.final_thought}\n<answer>\n\\boxed{{{plan_.answer}}}\n</answer>"
