"""The synthetic tasks' shared vocabulary: the renderer's colours and the multiple-choice format.

Its own module so that the set builder (:mod:`pipelines.data.synth`) and the task makers
(:mod:`~pipelines.data.synth_image`, :mod:`~pipelines.data.synth_video`) import it downward
instead of each other.
"""

from __future__ import annotations

from collections.abc import Sequence

# Well separated in RGB so that colour masks with a generous tolerance survive video compression.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 205, 30),
    "purple": (150, 60, 190),
    "cyan": (40, 200, 210),
}
MC_INSTRUCTION = "Answer with the option's letter from the given choices directly."


def mc_question(stem: str, options: Sequence[str]) -> str:
    lines = [stem] + [f"({chr(65 + i)}) {o}" for i, o in enumerate(options)] + [MC_INSTRUCTION]
    return "\n".join(lines)


def letter_of(options: Sequence[str], value: str) -> str:
    return chr(65 + list(options).index(value))
