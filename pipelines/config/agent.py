"""How one trajectory is run: turn, image and context limits, sampling, error handling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class AgentConfig(Section):
    """Limits and behaviour of the shared agent loop (used by RL rollouts and by evaluation)."""

    max_turns_train: int = Field(5, ge=1, le=100)
    """Maximum assistant turns per trajectory in RL rollouts (paper: 5)."""

    max_turns_eval: int = Field(30, ge=1, le=200)
    """Maximum assistant turns per trajectory in evaluation (paper: 30)."""

    max_images: int = Field(32, ge=1, le=1024)
    """Maximum images in one trajectory's context, input images included (paper: 32)."""

    max_context_tokens: int = Field(32768, ge=256, le=1_048_576)
    """Maximum tokens in the context (prompt + all turns); beyond it the trajectory stops with
    `context_overflow`."""

    max_new_tokens_per_turn: int = Field(2048, ge=8, le=65536)
    """Maximum tokens the model may generate in one assistant turn."""

    temperature: float = Field(1.0, ge=0.0, le=5.0)
    """Sampling temperature for rollouts (0 means greedy)."""

    code_temperature: float | None = Field(None, ge=0.0, le=5.0)
    """Sampling temperature for the tokens inside a `<code>` block in rollouts (Thyme's idea: a
    lower one keeps code runnable while the reasoning around it still explores); None: the same
    as `temperature`. Local engine only (it samples and trains each token at its own
    temperature); the verl engine refuses it at compose time, saying why
    (``pipelines.rl.verl.overrides.CODE_TEMPERATURE_UNSUPPORTED``)."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold for rollouts."""

    eval_temperature: float = Field(0.0, ge=0.0, le=5.0)
    """Sampling temperature in evaluation (0 means greedy, deterministic)."""

    draft_tokens: int = Field(8, ge=0, le=64)
    """Greedy decoding in the in-process engine (`eval.engine: hf`, at `eval_temperature: 0`)
    checks up to this many tokens in one forward pass, drafted from the n-grams of earlier turns
    (model-free speculative decoding; an agent's turns repeat themselves). The tokens kept are
    the ones greedy decoding picks, so answers change only where float rounding flips a
    near-tie. 0: one token a pass. Sampled turns (rollouts) are unaffected."""

    share_prefixes: bool = True
    """The in-process engine (`eval.engine: hf`, the local RL engine's rollouts) runs a prompt
    head that episodes share (at least 64 tokens of text before the first image: a family's
    instructions) through the model once and continues its states in every episode that starts
    with it, as vLLM's prefix cache does. The logits differ by float rounding only; on the
    demo's held-out video tasks it prefills a third of the tokens. False: every episode prefills
    its whole prompt."""

    cpu_threads: int = Field(1, ge=0, le=1024)
    """torch CPU threads while an in-process policy (`eval.engine: hf`, the local RL engine's
    rollouts) generates on the CPU; 0: leave torch's setting (one per core). The model's code
    runs in the sandboxes on the same cores meanwhile, and torch's idle threads spin between
    its operations on the cores the sandboxes need: 64 evaluation samples on two cores took
    11.8-13.1 s with one thread against 13.3-14.5 s with two (`pyvision perf eval`, alternated),
    with the same trajectories. With cores to spare more threads are faster (16 cores: 9.85
    samples/s at 4 against 6.0-6.8 at 1); 1 stays the default because at one thread a packed
    decode pass gives each row the padded pass's logits bit for bit, so the machine's core count
    does not change the trajectories. It covers generation and the processor's encoding of each
    turn. Training keeps its own setting (`rl.local.threads`)."""

    on_error: Literal["feedback", "terminate"] = "feedback"
    """`feedback`: a failing code block's traceback goes back to the model inside
    `<interpreter>`; `terminate`: the trajectory ends with `tool_error` (the original code's
    behaviour)."""

    image_min_pixels: int = Field(3136, ge=784, le=100_000_000)
    """Smallest pixel count an image is resized to before it enters the model's context."""

    image_max_pixels: int = Field(2_000_000, ge=784, le=100_000_000)
    """Largest pixel count an image is resized to before it enters the model's context (the
    sandbox always holds the full-resolution original)."""

    image_factor: Literal[28, 32] = 28
    """Image sides are resized to multiples of this many pixels, one visual token per factor x
    factor square: the vision tower's patch size times its merge size (Qwen2.5-VL: 14 x 2 = 28;
    Qwen3-VL: 16 x 2 = 32). Checked against the model's processor when a model is loaded."""

    video_context: Literal["on_demand", "uniform"] = "on_demand"
    """`on_demand`: no frames in the context, the model samples frames with code (the paper);
    `uniform`: a baseline that puts uniformly sampled frames in the context."""

    uniform_frames: int = Field(16, ge=1, le=1024)
    """Frames put in the context by the `uniform` video baseline."""
