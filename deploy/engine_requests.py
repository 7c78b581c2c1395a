"""A request's prompts to the choices that generate them: one EngineRequest per prompt and per n,
checked against the context, the stop-string bound and the log-probability budget; and the
`Generation` those choices make together, whose deltas every output format reads.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from deploy.cache_scope import request_salt
from deploy.errors import BadRequestError, ContextLengthError
from deploy.generation import Choice, ChoiceDelta, merge_streams, with_deadline
from deploy.logprobs import check_budget
from deploy.models import ServedModel
from deploy.reply import ReplySplit
from deploy.tools import DeclaredTools
from deploy.tracing import current_span
from frontend.reasoning import ReasoningSplitter
from scheduler.request import EngineRequest
from scheduler.structured_output import StructuredOutput


def request_timeout(m: ServedModel, asked: float | None) -> float:
    """A request's time limit in seconds: the model's, or the request's own when shorter."""
    limit = m.config.request_timeout_s
    return limit if asked is None else min(limit, asked)


@dataclass(frozen=True, slots=True)
class Prompts:
    """A request's prompts as token ids, and how their choices are named and sampled."""

    ids: list[list[int]]
    param: str  # the field they came from, named by a context-length error
    kind: str  # the response id's prefix: "cmpl", "chatcmpl"
    logprobs: int | None  # alternatives per sampled token (None: no log-probabilities)
    constraint: StructuredOutput | None = None
    # A chat's images (deploy/image_parts.py): one placeholder token each in its prompt, and the
    # tokens the engine's expansion adds beyond them (counted against the context here).
    images: tuple[Any, ...] = ()
    image_tokens: int = 0


@dataclass(slots=True)
class Generation:
    """A request's choices, about to stream from the replicas; what every output format reads.

    tools and opened are a chat's: the tools its replies may call, and whether its replies start
    inside a reasoning block (None: the model has no reasoning parser)."""

    model: ServedModel
    body: Any  # the sampling request (CompletionRequest, ChatCompletionRequest)
    choices: list[Choice]
    tools: DeclaredTools | None = None
    opened: bool | None = None

    @property
    def request_id(self) -> str:
        """The response's id: the choices' common prefix."""
        return self.choices[0].request.request_id.rsplit("-", 1)[0]

    @property
    def name(self) -> str:
        """The `model` a reply names: the adapter's as the client named it, else the served
        model's."""
        if self.choices and self.choices[0].request.lora_name is not None:
            return str(self.body.model)
        return self.model.config.model_name

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas as they arrive, until the request's deadline."""
        timeout = request_timeout(self.model, self.body.request_timeout_s)
        replica = self.model.replica
        session = getattr(self.body, "session_id", None)
        if session is not None:  # the fleet router reads it (cluster/serve_router.py)
            replica = replica.options(session_id=session)
        streams = [c.stream(replica) for c in self.choices]
        return with_deadline(merge_streams(streams), time.monotonic() + timeout)

    def reply_split(self) -> ReplySplit:
        """A new splitter of one choice's text into reasoning, content and tool calls."""
        return ReplySplit(self.tools, self.reasoning_splitter())

    def reasoning_splitter(self) -> ReasoningSplitter | None:
        reasoning = self.model.reasoning
        if reasoning is None or self.opened is None:
            return None
        return ReasoningSplitter(reasoning.fmt, self.opened)

    def reasoning_counter(self) -> Callable[[list[int]], int] | None:
        """(output token ids) -> how many are reasoning; None without a reasoning parser."""
        reasoning = self.model.reasoning
        if reasoning is None:
            return None
        return functools.partial(reasoning.num_reasoning_tokens, opened=bool(self.opened))


class ChoiceBuilder:
    """Builds a request's choices: n per prompt, each one EngineRequest."""

    def __init__(
        self, m: ServedModel, body: Any, prompts: Prompts, tenant: str, caller: str | None
    ) -> None:
        self.m, self.body, self.prompts = m, body, prompts
        self.tenant, self.caller = tenant, caller
        self.base_id = f"{prompts.kind}-{uuid.uuid4().hex}"
        self.lora = m.adapter(body.model)
        self.bad_words = m.frontend.bad_words_token_ids(body.bad_words or [])
        self.salt = request_salt(
            m.config.cache_scope, tenant, body.cache_salt, body.prompt_cache_key
        )

    def build(self, max_len: int) -> list[Choice]:
        """Every choice, once every prompt fits and the log-probabilities asked fit the budget."""
        choices: list[Choice] = []
        asked_logprobs = 0
        for p, prompt in enumerate(self.prompts.ids):
            max_tokens = self._max_tokens(prompt, max_len)
            self._check_stops()
            asked_logprobs += self._logprob_entries(prompt, max_tokens)
            choices += self._choices(p, prompt, max_tokens)
        body = self.body
        check_budget(
            asked_logprobs,
            self.m.config.max_logprob_entries,
            body.field_name("logprobs"),
            body.field_name("max_tokens"),
        )
        return choices

    def _max_tokens(self, prompt: list[int], max_len: int) -> int:
        """The prompt's max_tokens (unset: the context left), once its ids and length are valid."""
        try:
            self.m.frontend.check_token_ids(prompt)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="prompt") from None
        asked = self.body.max_tokens
        length = len(prompt) + self.prompts.image_tokens
        max_tokens = asked if asked is not None else max_len - length
        if max_tokens < 1 or length + max_tokens > max_len:
            raise ContextLengthError(
                max_len, length, max(max_tokens, asked or 0), self.prompts.param
            )
        return max_tokens

    def _check_stops(self) -> None:
        limit = self.m.config.max_stop_string_chars
        if any(len(s) > limit for s in self.body.stop):
            raise BadRequestError(
                f"stop: stop strings may have at most {limit} characters", param="stop"
            )

    def _logprob_entries(self, prompt: list[int], max_tokens: int) -> int:
        """The log-probabilities this prompt's n choices may return (sampled and prompt)."""
        body, logprobs = self.body, self.prompts.logprobs
        entries = body.n * max_tokens * (logprobs + 1) if logprobs is not None else 0
        if body.asked_prompt_logprobs is not None:
            entries += body.n * len(prompt) * (body.asked_prompt_logprobs + 1)
        return entries

    def _choices(self, p: int, prompt: list[int], max_tokens: int) -> list[Choice]:
        m = self.m
        hashes = m.frontend.block_hashes(
            prompt, m.config.engine.block_size, m.routing_lora_key(self.lora), self.salt
        )
        n = self.body.n
        return [self._choice(p * n + i, p, i, prompt, max_tokens, hashes) for i in range(n)]

    def _choice(
        self, index: int, p: int, i: int, prompt: list[int], max_tokens: int, hashes: list
    ) -> Choice:
        m = self.m
        return Choice(
            index,
            p,
            self._engine_request(index, i, prompt, max_tokens, hashes),
            m.frontend,
            m.metrics,
            m.config.max_migrations,
            prefill=m.prefill,
            trace=current_span(),  # the request's span when sampled (deploy/tracing.py)
        )

    def _engine_request(
        self, index: int, i: int, prompt: list[int], max_tokens: int, hashes: list
    ) -> EngineRequest:
        """The engine's request of choice i of this prompt (index: among all the choices)."""
        body = self.body
        params = body.sampling_params(
            max_tokens, self.prompts.logprobs, self.prompts.constraint, i, self.bad_words
        )
        params.check_vocab(self.m.frontend.info.vocab_size)
        return EngineRequest(
            request_id=f"{self.base_id}-{index}",
            prompt_token_ids=prompt,
            sampling_params=params,
            priority=body.priority,
            tenant=self.tenant,
            block_hashes=hashes,
            caller=self.caller,
            lora_name=self.lora,
            cache_salt=self.salt,
            images=self.prompts.images,
        )
