"""The tokenizer side of generation, shared by the OpenAI ingress and the offline LLM (no model
code).

Model facts are resolved once (ModelInfo); prompts are encoded one way (a rendered chat template
carries its own special tokens, a plain prompt gets the tokenizer's); stop ids, incremental
detokenization with stop strings, and the prompt block hashes all come from here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from jinja2 import TemplateError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from frontend.chat import DEFAULT_CHAT, ChatOptions, control_texts, encode_chat
from frontend.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream
from frontend.images import image_text
from scheduler.block_hash import hash_prompt_blocks
from scheduler.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from workers.model_files import context_limit_of, max_model_len_of, resolve_model
from workers.options import DEFAULT_CACHE_DIR

logger = logging.getLogger(__name__)

# Used when a tokenizer has no chat template (tiny test models): ChatML, like SmolLM2's own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What serving needs to know of a model, read once from its directory."""

    model_dir: str
    max_model_len: int  # the model's positions, capped: the default context
    vocab_size: int
    eos_token_ids: tuple[
        int, ...
    ]  # every id that ends a turn (config, generation config, tokenizer)
    context_limit: int | None = None  # positions uncapped: no max_model_len beyond it

    @classmethod
    def load(
        cls, model: str, cache_dir: str = DEFAULT_CACHE_DIR, tokenizer: Any = None
    ) -> ModelInfo:
        model_dir = resolve_model(model, cache_dir)
        # A vision-language model's facts are its language model's (LlavaConfig.text_config).
        config = AutoConfig.from_pretrained(model_dir).get_text_config()
        found = _configs_eos(model_dir, config)
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
        found.append(tokenizer.eos_token_id)
        return cls(
            model_dir=model_dir,
            max_model_len=max_model_len_of(config),
            vocab_size=int(config.vocab_size),
            eos_token_ids=tuple(sorted({i for i in found if isinstance(i, int)})),
            context_limit=context_limit_of(config),
        )


def _configs_eos(model_dir: str, config: Any) -> list[object]:
    """The end-of-turn ids the model's config and generation config declare: each an id, a list
    of ids, or None."""
    sources: list[Any] = [config]
    try:
        sources.append(GenerationConfig.from_pretrained(model_dir))
    except OSError:
        pass  # no generation_config.json
    found: list[object] = []
    for source in sources:
        ids = getattr(source, "eos_token_id", None)
        found.extend(ids if isinstance(ids, (list, tuple)) else [ids])
    return found


class Frontend:
    """Encodes prompts and chats, decodes streamed tokens, hashes prompt blocks for one model."""

    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self._controls = control_texts(tokenizer)
        self._image_text = image_text(tokenizer)  # Gemma 3's text around an image, or None

    @classmethod
    def load(cls, model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Frontend:
        """The frontend of `model` ("default", an HF directory or a .gguf file)."""
        model_dir = resolve_model(model, cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return cls(tokenizer, ModelInfo.load(model_dir, cache_dir, tokenizer))

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt: the tokenizer adds its specials (BOS) as the model was trained."""
        return self.tokenizer.encode(text, add_special_tokens=True)

    @property
    def chat_template(self) -> str:
        """The template's source (all of them, when the tokenizer has several by name)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(template.values())
        return template or FALLBACK_CHAT_TEMPLATE

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT,
    ) -> str:
        """The conversation through the model's chat template, ready for the assistant's turn
        (or continuing the last assistant message, as options ask)."""
        template = (
            None if getattr(self.tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        )
        rendered = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.template_kwargs,
        )
        return rendered if self._image_text is None else self._image_text.apply(rendered)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = DEFAULT_CHAT,
    ) -> list[int]:
        """A chat prompt: the template emits its own specials, so the tokenizer adds none; the
        messages' content is text, whatever control tokens it spells (frontend/chat.py)."""
        options.check(messages, self._controls)

        def render(msgs: Sequence[dict[str, Any]], tls: list[dict[str, Any]] | None) -> str:
            try:
                return self.render_chat(msgs, tls, options)
            except TemplateError as exc:  # the template's own raise_exception, or a bad use of it
                raise ValueError(f"messages: the chat template refused them: {exc}") from None

        return encode_chat(self.tokenizer, render, self._controls, messages, tools)

    def check_token_ids(self, token_ids: Sequence[int], field_name: str = "prompt") -> None:
        """ValueError unless every id is in the vocabulary (one bad id would fail a whole batch)."""
        if not token_ids:
            raise ValueError(f"{field_name}: must not be empty")
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= self.info.vocab_size:
            raise ValueError(
                f"{field_name}: token ids must be in [0, {self.info.vocab_size}), got {low}..{high}"
            )

    def text_stream(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> TextStream:
        """Incremental text of one generation, cut at the first stop string, decoded as params
        ask (special tokens, the stop string or stop token kept or not)."""
        params = params if params is not None else SamplingParams()
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            list(prompt_token_ids),
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        matcher = StopMatcher(list(params.stop), params.include_stop_str_in_output)
        return TextStream(detokenizer, matcher, params.include_stop_str_in_output)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each banned word as the token sequences that spell it: alone, and after a space (the
        way a word usually follows another); duplicates once."""
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValueError(
                        f"bad_words: a word encodes to more than {MAX_BAD_WORD_TOKENS} tokens"
                    )
                if ids:
                    found.setdefault(ids)
        return [list(ids) for ids in found]

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """params with its bad words encoded for this model's tokenizer, checked against its
        vocabulary."""
        if params.bad_words and not params.bad_words_token_ids:
            params = replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        params.check_vocab(self.info.vocab_size)
        return params

    @staticmethod
    def truncate(token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (all of it when unset)."""
        k = params.truncate_prompt_tokens
        return token_ids if k is None or k >= len(token_ids) else token_ids[-k:]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @staticmethod
    def block_hashes(
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        salt: str | None = None,
    ) -> list[int]:
        """The prompt's chained block hashes, as the scheduler and the router compute them; a
        request under a LoRA adapter passes its name (its blocks are never the base model's), a
        salted one its cache salt (its blocks are never another salt's)."""
        return hash_prompt_blocks(token_ids, block_size, lora_name=lora_name, salt=salt)
