"""The offline API: LLM(model=...).generate(prompts, params) and .chat(conversations, params)."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from engine.backends import default_executor
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.executor import Executor, ExecutorFactory
from engine.multimodal import chat_images, prompt_with_images
from frontend.chat import ChatOptions
from frontend.detokenizer import TextStream
from frontend.frontend import Frontend
from scheduler.outputs import RequestOutput, TokenLogprobs
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams
from workers.grammar_sandbox import GrammarSandbox, TokenizerSpec
from workers.runner import RunnerConfig
from workers.weight_transfer import WeightGroupSpec

if TYPE_CHECKING:
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)

# Text, token ids, or {"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}.
Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict]  # {"role", "content"} messages


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """A single prompt (text, token ids, or a prompt with images) rather than a batch of them."""
    return isinstance(prompts, (str, dict)) or bool(prompts and isinstance(prompts[0], int))


def _is_one_conversation(
    conversations: Conversation | Sequence[Conversation],
) -> TypeIs[Conversation]:
    """A single conversation (a list of messages) rather than a batch of them."""
    return bool(conversations and isinstance(conversations[0], dict))


@dataclass(slots=True)
class GenerationOutput:
    """The completion of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing precedes it),
    # then each prompt token's (id, logprob) followed by the alternatives.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    """An in-process engine with a tokenizer: batch generation over many prompts at once.

    `with LLM(...) as llm:` or `llm.shutdown()` releases its workers; so does dropping it.
    """

    def __init__(
        self,
        model: str = "default",
        dtype: str = "float32",
        device: str = "auto",
        tensor_parallel_size: int = 1,
        executor_factory: ExecutorFactory = default_executor,
        **kwargs: Any,
    ) -> None:
        """Engine and scheduler settings by name (EngineConfig, SchedulerConfig). Several ranks
        run as `distributed_executor_backend` says (engine/backends.py: a process per rank on
        this machine unless they do not fit, or Ray is asked for); executor_factory overrides."""
        config = EngineConfig.from_kwargs(
            model=model,
            dtype=dtype,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        made: list[Executor] = []  # what a failed construction must release

        def recorded(engine_config: EngineConfig, runner_config: RunnerConfig) -> Executor:
            made.append(executor_factory(engine_config, runner_config))
            return made[-1]

        try:
            self.engine = EngineCore(config, recorded)
            self.frontend = Frontend(
                AutoTokenizer.from_pretrained(self.engine.model_dir), self.engine.model_info
            )
            self.tokenizer = self.frontend.tokenizer
            self._grammars = GrammarSandbox(
                TokenizerSpec.of(self.tokenizer, self.engine.model_info.vocab_size),
                timeout_s=config.grammar_timeout_s,
            )
        except BaseException:
            for executor in made:
                executor.shutdown()
            raise
        self._ids = itertools.count()
        # Released by shutdown(), by the end of a `with` block, or when the LLM is collected:
        # a dropped tensor-parallel engine's worker actors and placement group would otherwise
        # hold their CPUs or GPUs until the process ends, and the next LLM would wait for them.
        # Not at interpreter exit: Ray releases the job's actors and groups itself then.
        self._finalizer = weakref.finalize(self, _release, self.engine, self._grammars)
        self._finalizer.atexit = False

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Complete each prompt (text or token ids); outputs come back in prompt order.

        lora: the LoRA adapter every prompt runs under, or one per prompt (None: the base
        model); adapters come from `lora_modules` or add_lora."""
        batch = [prompts] if _is_one_prompt(prompts) else prompts
        split = [prompt_with_images(p) if isinstance(p, dict) else (p, ()) for p in batch]
        texts = [p if isinstance(p, str) else None for p, _ in split]
        token_ids = [
            self.frontend.encode_prompt(p) if isinstance(p, str) else list(p) for p, _ in split
        ]
        images = [imgs for _, imgs in split]
        return self._run(texts, token_ids, sampling_params, use_tqdm, lora, images)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Reply to each conversation (a list of {"role", "content"} messages) via the chat
        template: a new assistant turn, or (continue_final_message) the last message continued;
        chat_template_kwargs are variables the template reads (`enable_thinking`)."""
        batch = [conversations] if _is_one_conversation(conversations) else conversations
        options = ChatOptions(
            add_generation_prompt, continue_final_message, dict(chat_template_kwargs or {})
        )
        split = [chat_images(c) for c in batch]  # image parts: the template's placeholders
        texts = [self.frontend.render_chat(c, options=options) for c, _ in split]
        token_ids = [self.frontend.encode_chat(c, options=options) for c, _ in split]
        images = [tuple(imgs) for _, imgs in split]
        return self._run(texts, token_ids, sampling_params, use_tqdm, lora, images)

    def add_lora(self, name: str, path: str) -> None:
        """Make a PEFT adapter directory usable as `name` (EngineCore.add_lora)."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def update_weights(
        self, path: str | None = None, *, from_group: bool = False, in_flight: str = "finish"
    ) -> int:
        """Replace the model's weights from a safetensors checkpoint (`path`) or from the trainer
        of the weight group (`from_group`, after init_weight_group); the number of tensors
        replaced. Every tensor is checked first (ValueError naming a missing tensor, a wrong shape
        or dtype, a NaN or inf: the old weights stay). The prefix cache is emptied; LoRA adapters
        stay loaded (EngineCore.update_weights, docs/rl.md)."""
        done = self.engine.update_weights(path, from_group, in_flight)
        while not done.done():  # only a caller stepping the engine elsewhere leaves work in flight
            self.engine.step()
        return done.result()

    def init_weight_group(
        self, init_method: str, world_size: int, rank: int, timeout_s: float = 600.0
    ) -> None:
        """Join a trainer's weight group (tcp://host:port, the trainer rank 0); this engine's
        tensor-parallel rank r joins as rank + r. Blocks until every member has joined."""
        self.engine.init_weight_group(WeightGroupSpec(init_method, world_size, rank, timeout_s))

    def destroy_weight_group(self) -> None:
        self.engine.destroy_weight_group()

    def sleep(self, level: int = 1, discard_weights: bool = False) -> None:
        """Free the KV cache (level 1), and move the weights to host memory or drop them (level 2,
        `discard_weights`); generate raises EngineAsleepError until wake_up."""
        self.engine.sleep(level, discard_weights)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last") -> list[list[float]]:
        """One normalised embedding per prompt (text or token ids): the final hidden states of
        its tokens pooled (`last` token or `mean`), batched by the scheduler as prefills."""
        batch = [prompts] if _is_one_prompt(prompts) else prompts
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        vectors: dict[str, list[float] | None] = {}
        try:
            for p in batch:
                if isinstance(p, dict):
                    raise ValueError("prompt: embed takes text or token ids, not images")
                ids = self.frontend.encode_prompt(p) if isinstance(p, str) else list(p)
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(EngineRequest(rid, ids, params))
                vectors[rid] = None
            self._pool_all(vectors)
        finally:
            left = [rid for rid, v in vectors.items() if v is None]
            if left:
                self.engine.abort_requests(left)
        return [v for v in vectors.values() if v is not None]

    def _run(
        self,
        prompts: Sequence[str | None],
        token_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora: str | Sequence[str | None] | None = None,
        images: Sequence[tuple[Any, ...]] | None = None,
    ) -> list[GenerationOutput]:
        loras = _loras_per_prompt(lora, len(token_ids))
        per_prompt = images if images is not None else [()] * len(token_ids)
        params = [
            self.frontend.prepare(sp) for sp in _params_per_prompt(sampling_params, len(token_ids))
        ]
        token_ids = [self.frontend.truncate(ids, sp) for ids, sp in zip(token_ids, params)]
        for constraint in {sp.structured for sp in params if sp.structured is not None}:
            self._grammars.check(constraint)  # a bad grammar is the caller's ValueError, now
        outputs: dict[str, GenerationOutput] = {}
        texts: dict[str, TextStream] = {}
        live: set[str] = set()
        with tqdm(total=len(token_ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            try:
                for prompt, ids, sp, name, imgs in zip(
                    prompts, token_ids, params, loras, per_prompt
                ):
                    rid = f"llm-{next(self._ids)}"
                    request = EngineRequest(rid, ids, sp, lora_name=name, images=imgs)
                    self.engine.add_request(request)
                    live.add(rid)
                    outputs[rid] = GenerationOutput(
                        rid, prompt, ids, logprobs=[] if sp.logprobs is not None else None
                    )
                    # The text is built as the served one is, so stop strings cut it at once.
                    texts[rid] = self.frontend.text_stream(ids, sp)
                while live:
                    finished = self._step(outputs, texts)
                    live -= finished
                    bar.update(len(finished))
            finally:
                if live:  # a bad prompt or an interruption: nothing of this call stays queued
                    self.engine.abort_requests(list(live))
        return list(outputs.values())

    def _pool_all(self, vectors: dict[str, list[float] | None]) -> None:
        """Step the engine until every request of `vectors` has finished with its embedding."""
        live = set(vectors)
        while live:
            for ro in self.engine.step():
                if ro.request_id in live and ro.finished:
                    if ro.pooled is None:
                        raise RuntimeError(
                            f"{ro.request_id}: finished ({ro.finish_reason}) "
                            f"without its embedding: {ro.error}"
                        )
                    vectors[ro.request_id] = ro.pooled
                    live.discard(ro.request_id)

    def _step(self, outputs: dict[str, GenerationOutput], texts: dict[str, TextStream]) -> set[str]:
        """One engine step: tokens and text for each request; the ids of those that finished (a
        stop string finishes its request here, and the engine aborts it)."""
        finished = set()
        for ro in self.engine.step():
            out = outputs.get(ro.request_id)
            if out is None or ro.request_id not in texts:
                continue
            _record(out, ro)
            text = texts[ro.request_id]
            text.feed(ro.new_token_ids, ro.finished, ro.finished and ro.finish_reason == "stop")
            if text.stopped or ro.finished:
                if not ro.finished:
                    self.engine.abort_requests([ro.request_id])
                # A stop string completed by the last token still finishes as "stop".
                out.finish_reason = "stop" if text.stopped else ro.finish_reason
                out.text = texts.pop(ro.request_id).text
                finished.add(ro.request_id)
        return finished

    def shutdown(self) -> None:
        """Stop the workers (a tensor-parallel engine's actors and placement group) and the
        grammar checkers; later calls do nothing."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _release(engine: EngineCore, grammars: GrammarSandbox) -> None:
    """What an LLM holds outside its own memory; must not refer to the LLM (it would never be
    collected)."""
    grammars.close()
    engine.shutdown()


def _loras_per_prompt(lora: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if not isinstance(lora, Sequence):
        raise ValueError(f"lora: must be an adapter name, None or one per prompt, got {lora!r}")
    names = list(lora)
    if len(names) != n:
        raise ValueError(f"lora: got {len(names)} adapter names for {n} prompts")
    return names


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * n
    else:
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    for sp in params:
        if sp.n != 1:
            raise ValueError(
                f"n: LLM.generate returns one completion per prompt, got n={sp.n}; "
                "repeat the prompt instead"
            )
    return params


def _record(out: GenerationOutput, ro: RequestOutput) -> None:
    """A step's tokens, logprobs and cached-token count of one request, added to its output."""
    out.token_ids.extend(ro.new_token_ids)
    out.num_cached_tokens = ro.num_cached_tokens
    if out.logprobs is not None and ro.new_logprobs:
        out.logprobs.extend(ro.new_logprobs)
    if ro.prompt_logprobs is not None and out.prompt_logprobs is None:
        out.prompt_logprobs = [None, *ro.prompt_logprobs]
