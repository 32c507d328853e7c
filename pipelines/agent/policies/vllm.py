"""vLLM in-process (`--engine vllm`): one ``vllm.LLM``, every active episode in one ``chat`` call.

Each episode is a chat in OpenAI message form, as the OpenAI policy builds it, except that images
stay PIL objects (``{"type": "image_pil", "image_pil": img}`` parts) instead of base64 data URLs.
Every turn sends the whole conversation; vLLM's prefix cache reuses the shared prefix, so a turn
costs the new tokens only. Generation stops at ``</code>``, kept in the text
(``include_stop_str_in_output``). Token counts come from vLLM's ``RequestOutput``: the prompt ids
of an episode's first request (prompt), the ids generated each turn (generated), and the prompt
ids of the latest request (context); visual tokens are counted per image with Qwen2.5-VL's resize
rule, as for the OpenAI policy.

vLLM cannot share the training environment (it pins other torch and transformers versions than
verl 0.9.1 and LLaMA-Factory 0.9.5), so it is imported only here, and its absence is a user error
that says how to get it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.chat import ChatMessages
from pipelines.agent.protocol import CODE_STOP, truncate_at_code_stop
from pipelines.config.agent import AgentConfig
from pipelines.errors import UserError

VLLM_VERSION = "0.33.0"
"""The vLLM release the install hint names (its torch and transformers pins are in INSTALL_HINT)."""

INSTALL_HINT = (
    f"vLLM {VLLM_VERSION} pins torch 2.14.0 and transformers>=5.16.1, which conflict with verl "
    f"0.9.1 and LLaMA-Factory here, so give it its own GPU environment (`python3.11 -m venv "
    f".venv-vllm && .venv-vllm/bin/pip install vllm=={VLLM_VERSION}`), serve the model from it "
    f"(`.venv-vllm/bin/vllm serve MODEL --limit-mm-per-prompt '{{\"image\":32}}' --port 8000`) "
    f"and evaluate with `pyvision eval --engine openai --model http://localhost:8000`; "
    f"in-process --engine vllm needs pyvision and vLLM in one environment without the training "
    f"stack")


def import_vllm() -> Any:
    """The ``vllm`` module, or a UserError saying how to install it."""
    try:
        import vllm
    except ImportError as exc:
        missing = getattr(exc, "name", None) == "vllm"
        what = "not installed" if missing else f"installed but does not import ({exc})"
        raise UserError(f"--engine vllm needs vLLM, which is {what} in this environment",
                        hint=INSTALL_HINT) from None
    return vllm


@dataclass
class _Chat:
    messages: list[dict]
    visual: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    last_prompt_tokens: int = 0
    last_generated: int = 0
    turns: int = 0


class VLLMPolicy(ChatMessages):
    """Qwen2.5-VL, Qwen3-VL (or any chat VLM vLLM serves) through ``vllm.LLM.chat``."""

    name = "vllm"
    Chat = _Chat

    def __init__(self, model: str, *, agent_cfg: AgentConfig | None = None, seed: int = 0,
                 **engine_kwargs: Any) -> None:
        cfg = agent_cfg or AgentConfig()
        self.vllm = import_vllm()
        self.min_pixels = cfg.image_min_pixels
        self.max_pixels = cfg.image_max_pixels
        self.factor = cfg.image_factor
        kwargs = {"limit_mm_per_prompt": {"image": cfg.max_images},
                  # The loop already resized every image to these bounds; the processor must not
                  # resize them again with its own defaults.
                  "mm_processor_kwargs": {"min_pixels": cfg.image_min_pixels,
                                          "max_pixels": cfg.image_max_pixels},
                  "seed": seed, **engine_kwargs}
        try:
            self.llm = self.vllm.LLM(model=model, **kwargs)
        except (OSError, ValueError) as exc:
            raise UserError(f"vLLM cannot load model '{model}': {str(exc).splitlines()[0][:200]}",
                            hint="pass a local Hugging Face model folder, or a hub id reachable "
                                 "from here") from None

    # -- conversation state --------------------------------------------------------------------

    def image_part(self, image: Any) -> dict:
        return {"type": "image_pil", "image_pil": image}

    def context_tokens(self, handle: _Chat) -> int:
        return handle.last_prompt_tokens + handle.last_generated

    def token_counts(self, handle: _Chat) -> dict[str, int]:
        return {"prompt": handle.prompt_tokens, "generated": handle.generated,
                "observation": max(0, self.context_tokens(handle) - handle.prompt_tokens
                                   - handle.generated),
                "visual": handle.visual}

    # -- generation ----------------------------------------------------------------------------

    def generate(self, handles: list[_Chat], sampling: Sampling) -> list[Generation]:
        params = self.vllm.SamplingParams(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, stop=[CODE_STOP], include_stop_str_in_output=True)
        outputs = self.llm.chat([h.messages for h in handles], params, use_tqdm=False)
        return [self._record(h, out) for h, out in zip(handles, outputs)]

    def _record(self, handle: _Chat, out: Any) -> Generation:
        completion = out.outputs[0]
        text = completion.text or ""
        n_prompt, n_new = len(out.prompt_token_ids or []), len(completion.token_ids or [])
        if handle.turns == 0:
            handle.prompt_tokens = n_prompt
        handle.turns += 1
        handle.last_prompt_tokens, handle.last_generated = n_prompt, n_new
        handle.generated += n_new
        if completion.finish_reason == "stop" and completion.stop_reason == CODE_STOP \
                and CODE_STOP not in text:
            text += CODE_STOP  # a build that ignores include_stop_str_in_output
        if CODE_STOP in text:
            text, finish = truncate_at_code_stop(text), "code"
        else:
            finish = "length" if completion.finish_reason == "length" else "eos"
        handle.messages.append({"role": "assistant", "content": text})
        return Generation(text, finish, n_new)  # type: ignore[arg-type]
