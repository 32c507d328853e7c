"""The PyVision interaction protocol: what the model writes and what the environment answers.

Model turn::

    reasoning ...
    <code>
    ```python
    ...
    ```
    </code>

Generation stops at ``</code>`` (kept). The environment runs the code and answers with a user turn::

    <interpreter>
    Text Result:
    ...printed output...
    Image Result:
    Figure 2: <image>
    </interpreter>

The episode ends at ``<answer>\\n\\boxed{...}\\n</answer>``. An answer in a turn ends the episode
even when the turn also has code. Parsing is tolerant of what small or sampled models produce:
missing newlines, nested braces in ``\\boxed{}``, several answers (the last one wins), an
unclosed final ``<answer>`` cut off by the length limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

CODE_STOP = "</code>"
_CODE_BLOCK_RE = re.compile(r"<code>\s*```(?:python|py)?[ \t]*\n?(.*?)```\s*</code>", re.DOTALL)
_FENCED_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\boxed\s*\{")


@dataclass(frozen=True)
class ParsedTurn:
    """What one model turn asks for."""

    kind: Literal["answer", "code", "none"]
    answer: str | None = None
    raw_answer: str | None = None
    code: str | None = None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}`` works)."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        # Unbalanced (cut off): try an earlier one.
    return None


def extract_answer(text: str) -> tuple[str | None, str | None]:
    """(answer, raw text inside the answer tag) of the last answer in ``text``, or (None, None)."""
    matches = _ANSWER_RE.findall(text)
    raw = matches[-1] if matches else None
    if raw is None:
        tail = text.rfind("<answer>")
        if tail < 0:
            return None, None
        raw = text[tail + len("<answer>"):]  # cut off before </answer>
        boxed = last_boxed(raw)
        return (boxed, raw) if boxed is not None else (None, None)
    boxed = last_boxed(raw)
    answer = boxed if boxed is not None else raw.strip()
    return (answer if answer else None), raw


def extract_code(text: str) -> str | None:
    """The last ``<code>```python ...```</code>`` block, else the last ```python fenced block."""
    blocks = _CODE_BLOCK_RE.findall(text)
    if not blocks:
        blocks = _FENCED_RE.findall(text)
    if not blocks:
        return None
    code = blocks[-1].strip("\n")
    return code if code.strip() else None


def truncate_at_code_stop(text: str) -> str:
    """Drop anything generated after the first ``</code>`` that closes a code block."""
    i = text.find(CODE_STOP)
    return text if i < 0 else text[: i + len(CODE_STOP)]


def stopped_inside_code(text: str) -> bool:
    """True when ``text`` ends inside an open ``<code>`` block with no answer after it: what a
    turn looks like when a server stopped at ``</code>`` and dropped the stop string."""
    start = text.rfind("<code>")
    return start >= 0 and CODE_STOP not in text[start:] and "<answer>" not in text[start:]


_CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>",
                 "<|image_pad|>")


def format_problems(turns: list[str]) -> list[str]:
    """What keeps the assistant turns of a finished trajectory from the exact protocol (empty
    when every turn is exact): each turn but the last is reasoning then exactly one
    ``<code>```python ... ```</code>`` block and nothing after it; the last is reasoning then
    exactly one ``<answer>...\\boxed{...}...</answer>`` and nothing after it; no turn writes an
    ``<interpreter>`` turn of its own or a chat-template marker.

    Parsing (:func:`parse_turn`) is tolerant, so a small model's near misses still run; SFT
    data must not teach them."""
    out: list[str] = []
    if not turns:
        return ["no assistant turn"]
    for i, text in enumerate(turns, start=1):
        last = i == len(turns)
        where = f"turn {i}"
        if not text.strip():
            out.append(f"{where} is empty")
            continue
        if any(m in text for m in _CHAT_MARKERS):
            out.append(f"{where} has a chat-template marker")
        if "<interpreter>" in text or "</interpreter>" in text:
            out.append(f"{where} writes an <interpreter> turn itself")
        n_open, n_close = text.count("<code>"), text.count(CODE_STOP)
        n_ans, n_ans_close = text.count("<answer>"), text.count("</answer>")
        if last:
            if n_open or n_close:
                out.append(f"{where} (the answer) has a code block")
            if n_ans != 1 or n_ans_close != 1:
                out.append(f"{where} has {n_ans} <answer> and {n_ans_close} </answer> tags")
            elif not text.rstrip().endswith("</answer>"):
                out.append(f"{where} goes on after </answer>")
            else:
                raw = text[text.find("<answer>") + len("<answer>"): text.find("</answer>")]
                if len(_BOXED_RE.findall(raw)) != 1 or last_boxed(raw) is None:
                    out.append(f"{where}: the answer is not one \\boxed{{...}}")
        else:
            if n_ans or n_ans_close:
                out.append(f"{where} answers before its code ran")
            if n_open != 1 or n_close != 1:
                out.append(f"{where} has {n_open} <code> and {n_close} </code> tags")
            elif not text.rstrip().endswith(CODE_STOP) or len(_CODE_BLOCK_RE.findall(text)) != 1:
                out.append(f"{where}: the code is not one <code>```python ... ```</code> block")
    return out


def parse_turn(text: str) -> ParsedTurn:
    answer, raw = extract_answer(text)
    if answer is not None:
        return ParsedTurn("answer", answer=answer, raw_answer=raw)
    code = extract_code(text)
    if code is not None:
        return ParsedTurn("code", code=code)
    return ParsedTurn("none")


def inert_markers(text: str) -> str:
    """``text`` (what the code printed) with every ``<|...|>`` chat-template marker broken by a
    zero-width space: the tokenizer would read ``<|im_end|>`` as a real turn end and
    ``<|image_pad|>`` as an image's token (the processor then fails for want of its image), so
    the code could forge turns or end the run that feeds the model."""
    return text.replace("<|", "<\u200b|")


def format_observation(status: str, stdout: str, stderr: str, n_images: int,
                       first_figure: int, on_error: str) -> list[dict]:
    """The interpreter turn as chat content parts (text, and one image part per figure).

    Errors go back to the model (``on_error: feedback``) as ``Error (<status>):`` plus the
    traceback, so it can fix its code.
    """
    text = "<interpreter>\nText Result:\n"
    body = stdout.rstrip("\n")
    if status != "ok" and on_error == "feedback":
        body = (body + "\n" if body else "") + f"Error ({status}):\n{stderr.rstrip()}"
    text += (inert_markers(body) if body else "None") + "\n"
    parts: list[dict] = []
    if n_images:
        text += "Image Result:\n"
        parts.append({"type": "text", "text": text})
        for k in range(n_images):
            parts.append({"type": "text", "text": f"Figure {first_figure + k}: "})
            parts.append({"type": "image"})
            parts.append({"type": "text", "text": "\n"})
        parts.append({"type": "text", "text": "</interpreter>"})
    else:
        parts.append({"type": "text", "text": text + "</interpreter>"})
    return merge_text_parts(parts)


def merge_text_parts(parts: list[dict]) -> list[dict]:
    """Join adjacent text parts (fewer, larger strings; identical rendering)."""
    out: list[dict] = []
    for p in parts:
        if p.get("type") == "text" and out and out[-1].get("type") == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
        else:
            out.append(dict(p))
    return out


def parts_to_text(parts: list[dict], image_token: str = "<image>") -> str:
    """Content parts as one string with one placeholder per image (LLaMA-Factory style)."""
    return "".join(p["text"] if p.get("type") == "text" else image_token for p in parts)
