"""A tiny, randomly initialised Qwen2.5-VL, built offline and deterministically.

It is a real ``Qwen2_5_VLForConditionalGeneration`` with a real Qwen2.5-VL processor, saved in
standard Hugging Face format, so transformers, LLaMA-Factory, verl and vLLM load it unchanged. Only
its size and its tokenizer differ from the released model: the tokenizer is a byte-level BPE
trained here on the project's own kind of text (with Qwen's special tokens and Qwen2-VL's chat
template), so sequences stay short and the vocabulary stays small.

Sizes
-----
``nano``   ~0.4M parameters, 1024-token vocabulary: unit tests.
``small``  a few million parameters, 4096-token vocabulary: the embedded demo, which must learn the
           synthetic tasks on two CPU cores in minutes.

Images are kept cheap in tokens: patches of 14 px merged 2x2, so one token per 28x28 pixels, and
at most ``max_pixels`` = 50176 (64 tokens) per image unless a recipe asks for more.

Architectures
-------------
``qwen2_5_vl`` (default) as above. ``qwen3_vl`` builds a ``Qwen3VLForConditionalGeneration``
(interleaved mRoPE, DeepStack vision features, patches of 16 px merged 2x2: one token per 32x32
pixels, so recipes use ``agent.image_factor: 32``) with a ``Qwen3VLProcessor`` and the
Qwen3-VL-Instruct chat template's rules (no default system message), so the agent protocol,
the token contexts and the verl agent loop are tested against a Qwen3-VL processor and template.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipelines.errors import UserError
from pipelines.fsutil import atomic_dir

Size = Literal["nano", "small"]
Arch = Literal["qwen2_5_vl", "qwen3_vl"]
ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# One content item of a user turn, the same in both families' templates: an image or a video as
# vision-start / pad / vision-end (numbered with add_vision_id), or its text.
_CONTENT_PART = (
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
)

# Qwen2-VL's official chat template (default system message included), so that prompts rendered
# with apply_chat_template match LLaMA-Factory's qwen2_vl template token for token.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    + _CONTENT_PART + "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3-VL-Instruct's rules for what we render: no default system message, images and videos as
# vision-start / pad / vision-end, "<|im_start|>assistant\n" as the generation prompt.
QWEN3_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    + _CONTENT_PART + "{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_PATCH = 16


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    max_positions: int
    corpus_docs: int


SPECS: dict[str, TinySpec] = {
    "nano": TinySpec(vocab_size=1024, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                     mrope_section=(2, 3, 3), vision_depth=2, vision_hidden=64, vision_heads=2,
                     vision_intermediate=128, max_positions=8192, corpus_docs=600),
    # Sized for 2 CPU cores: ~0.6 s per optimiser step on 4 x 450 tokens (the 256-wide model took
    # 0.94 s and learned no faster per step on the synthetic tasks).
    "small": TinySpec(vocab_size=4096, hidden=192, intermediate=512, layers=4, heads=4, kv_heads=2,
                      mrope_section=(6, 9, 9), vision_depth=2, vision_hidden=128,
                      vision_heads=2, vision_intermediate=256, max_positions=16384,
                      corpus_docs=3000),
}

# Released models' layer shapes, with random weights and the shipped tiny tokenizer (so the
# vocabulary, and the embedding, stay small): for measuring memory and time of a training step at
# that scale on a GPU before downloading any weights (`pyvision perf rl --size qwen2.5-vl-7b`).
# Qwen2.5-VL-7B-Instruct's config.json: hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944;
# a 32-block vision tower of width 1280 (16 heads, MLP 3420) projecting to 3584.
SHAPES: dict[str, TinySpec] = {
    "qwen2.5-vl-7b": TinySpec(vocab_size=0, hidden=3584, intermediate=18944, layers=28, heads=28,
                              kv_heads=4, mrope_section=(16, 24, 24), vision_depth=32,
                              vision_hidden=1280, vision_heads=16, vision_intermediate=3420,
                              max_positions=128000, corpus_docs=0),
}

IMAGE_MIN_PIXELS = 3136
IMAGE_MIN_PIXELS_QWEN3 = 4096  # 2 x 2 tokens of 32 x 32 pixels
IMAGE_MAX_PIXELS = 50176
VIDEO_MAX_PIXELS = 12544


def train_tokenizer(spec: TinySpec, seed: int, extra_corpus: Iterable[str] = ()):
    """A byte-level BPE (``tokenizers``) with Qwen's special tokens, wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipelines.models.corpus import builtin_corpus, prompt_template_texts

    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenisation: digits are split one by one, so numbers copy token by token.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    docs = [*prompt_template_texts(), *builtin_corpus(seed, spec.corpus_docs), *extra_corpus]
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], clean_up_tokenization_spaces=False,
        model_max_length=spec.max_positions, padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _special_ids_and_head_dim(spec: TinySpec, tokenizer) -> tuple[dict[str, int], int]:
    """The special tokens' ids and the attention head size, checked against the mRoPE sections
    (shared by the Qwen2.5-VL and Qwen3-VL builders)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = spec.hidden // spec.heads
    assert sum(spec.mrope_section) * 2 == head_dim, "mrope sections must cover head_dim / 2"
    return ids, head_dim


def build_config(spec: TinySpec, tokenizer):
    from transformers import Qwen2_5_VLConfig

    ids, _ = _special_ids_and_head_dim(spec, tokenizer)
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": spec.max_positions, "max_window_layers": spec.layers,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": list(spec.mrope_section)},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"], "tie_word_embeddings": True,
        },
        vision_config={
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate, "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 112, "tokens_per_second": 2,
            "fullatt_block_indexes": [spec.vision_depth - 1],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        # Tied input/output embeddings: at 4k x 256 they are a fifth of the model, and the small
        # model learns faster with one copy (the released 3B Qwen2.5-VL ties them too).
        tie_word_embeddings=True,
    )


def build_config_qwen3(spec: TinySpec, tokenizer):
    from transformers import Qwen3VLConfig

    ids, head_dim = _special_ids_and_head_dim(spec, tokenizer)
    return Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": spec.hidden, "head_dim": head_dim,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": spec.max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": list(spec.mrope_section),
                                "mrope_interleaved": True},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"], "tie_word_embeddings": True,
        },
        vision_config={
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate, "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden, "patch_size": QWEN3_PATCH, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_processor_qwen3(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    pixels = {"min_pixels": IMAGE_MIN_PIXELS_QWEN3, "max_pixels": IMAGE_MAX_PIXELS}
    image_processor = Qwen2VLImageProcessor(**pixels, patch_size=QWEN3_PATCH,
                                            temporal_patch_size=2, merge_size=2,
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(patch_size=QWEN3_PATCH, temporal_patch_size=2,
                                            merge_size=2, size={"shortest_edge": 4096,
                                                                "longest_edge": VIDEO_MAX_PIXELS})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=QWEN3_CHAT_TEMPLATE)


def build_processor(tokenizer):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS,
                                            patch_size=14, temporal_patch_size=2, merge_size=2)
    video_processor = Qwen2VLVideoProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS,
                                            patch_size=14, temporal_patch_size=2, merge_size=2)
    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               video_processor=video_processor, chat_template=CHAT_TEMPLATE)


MODEL_CARD = """# Tiny Qwen2.5-VL ({size}, seed {seed})

Built offline by `pyvision model tiny` (PyVision-RL toolkit). Random weights: it knows nothing
until trained. It exists for tests and for the embedded CPU demo, where SFT and RL teach it the
PyVision protocol on synthetic tasks.

- Architecture: `Qwen2_5_VLForConditionalGeneration`, {params:,} parameters
  (vision {vision_params:,}); text hidden {hidden}, {layers} layers; vocabulary {vocab}.
- Tokenizer: byte-level BPE trained locally, Qwen special tokens, Qwen2-VL chat template.
- Images: {min_pixels}..{max_pixels} pixels (one token per 28x28 px).
"""


def build_tiny_model(out_dir: str | Path, size: Size = "nano", seed: int = 0,
                     extra_corpus: Iterable[str] = (), *, force: bool = False,
                     arch: Arch = "qwen2_5_vl", tokenizer_from: str | Path | None = None) -> Path:
    """Build a tiny Qwen2.5-VL (or, with ``arch="qwen3_vl"``, Qwen3-VL) into ``out_dir``
    (atomically); return the path. ``tokenizer_from``: reuse the tokenizer of another tiny
    model instead of training one (seconds instead of minutes; tests pair the two models)."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    if size not in SPECS:
        raise UserError(f"unknown tiny model size '{size}'", hint="use --size nano or --size small")
    if arch not in ARCHS:
        raise UserError(f"unknown tiny model architecture '{arch}'",
                        hint=f"use one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty", hint="pass --force or another folder")
    spec = SPECS[size]
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    else:
        tokenizer = train_tokenizer(spec, seed, extra_corpus)
    qwen3 = arch == "qwen3_vl"
    config = (build_config_qwen3 if qwen3 else build_config)(spec, tokenizer)
    processor = (build_processor_qwen3 if qwen3 else build_processor)(tokenizer)
    torch.manual_seed(seed)
    model_class = Qwen3VLForConditionalGeneration if qwen3 else Qwen2_5_VLForConditionalGeneration
    model = model_class(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[config.text_config.eos_token_id, config.text_config.bos_token_id],
        pad_token_id=config.text_config.pad_token_id, do_sample=False)
    info = describe_module(model)
    with atomic_dir(out, overwrite=force) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        card = MODEL_CARD.format(
            size=size, seed=seed, params=info["parameters"], vision_params=info["vision_parameters"],
            hidden=spec.hidden, layers=spec.layers, vocab=len(tokenizer),
            min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS)
        if qwen3:
            card = (card.replace("Qwen2.5-VL", "Qwen3-VL").replace(
                "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
                .replace("Qwen2-VL chat template", "Qwen3-VL-Instruct chat template rules")
                .replace("one token per 28x28 px", "one token per 32x32 px: agent.image_factor 32"))
        (tmp / "README.md").write_text(card, encoding="utf-8")
        (tmp / "pyvision_tiny.json").write_text(json.dumps(
            {"size": size, "seed": seed, "arch": arch, **info, "vocab_size": len(tokenizer)},
            indent=2) + "\n")
    return out


def shipped_base(size: str) -> Path:
    """Where the repository keeps the pretrained tiny base of ``size`` (made by `pyvision model
    pretrain`, checked against its manifest by ``pretrain.copy_shipped_base``)."""
    return Path(__file__).resolve().parent / "weights" / f"tiny-{size}"


def build_shape_model(name: str, *, device: str, dtype: Any, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor): a Qwen2.5-VL with the layer shapes of :data:`SHAPES` ``name`` and
    random weights, made directly on ``device`` in ``dtype`` (nothing is written to disk), with
    the shipped tiny base's processor. Its generations are noise: it measures cost, not skill."""
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    if name not in SHAPES:
        raise UserError(f"unknown model shape '{name}'", hint=f"use one of {', '.join(SHAPES)}")
    processor = AutoProcessor.from_pretrained(str(shipped_base("small")))
    config = build_config(SHAPES[name], processor.tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config.update(eos_token_id=[config.text_config.eos_token_id,
                                                 config.text_config.bos_token_id],
                                   pad_token_id=config.text_config.pad_token_id, do_sample=False)
    return model.eval(), processor


def describe_module(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    return {"parameters": total, "vision_parameters": vision, "language_parameters": total - vision}


def describe_model(path: str | Path) -> dict[str, Any]:
    """Parameters (total / vision / language), vocabulary, dtype and size on disk of a model."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    text = getattr(config, "text_config", config)
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"path": str(path), "model_type": config.model_type, **describe_module(model),
            "vocab_size": text.vocab_size, "dtype": str(getattr(text, "dtype", None) or
                                                         getattr(config, "dtype", "float32")),
            "disk_bytes": disk}
