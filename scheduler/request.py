"""A generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field

from scheduler.multimodal import MAX_IMAGES_PER_REQUEST, ImageLike, ImageSpan, MultiModalInputs
from scheduler.sampling_params import SamplingParams
from settings import clipped

# Priorities order a heap; a bounded range keeps comparisons cheap and the values meaningful.
MAX_PRIORITY = 2**31 - 1
MAX_TENANT_CHARS = 256
# A cache salt (vLLM's `cache_salt`, or the ingress's digest of a tenant's scope): a string the
# first block's hash is keyed by; bounded so that it stays a small input to every chain's seed.
MAX_CACHE_SALT_CHARS = 1024
# An adapter name: what a URL path, a metric label and a log line can carry unescaped.
MAX_LORA_NAME_CHARS = 64
_LORA_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_LORA_NAME_CHARS}}}")


def check_lora_name(name: object, field_name: str = "lora_name") -> str:
    """name if it is a valid LoRA adapter name (1..64 of [A-Za-z0-9._-]), else ValueError."""
    if not isinstance(name, str) or _LORA_NAME.fullmatch(name) is None:
        raise ValueError(
            f"{field_name}: must be 1 to {MAX_LORA_NAME_CHARS} characters of [A-Za-z0-9._-], "
            f"got {clipped(repr(name))}"
        )
    return name


def check_lora_identity(
    identity: object, name: str | None = None, field_name: str = "lora_identity"
) -> str:
    """identity if it is `<adapter name>@<digest>` (of adapter `name` when given), else
    ValueError naming field_name."""
    if isinstance(identity, str) and len(identity) <= 2 * MAX_LORA_NAME_CHARS:
        base, at, digest = identity.partition("@")
        if at and digest and _LORA_NAME.fullmatch(base) and (name is None or base == name):
            return identity
    raise ValueError(f"{field_name}: must be `<lora_name>@<digest>`, got {clipped(repr(identity))}")


def check_cache_salt(salt: object, field_name: str = "cache_salt") -> str:
    """salt if it is a non-empty string of at most MAX_CACHE_SALT_CHARS characters, else
    ValueError naming field_name."""
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        size = f"{len(salt)} characters" if isinstance(salt, str) else clipped(repr(salt))
        raise ValueError(
            f"{field_name}: must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, got {size}"
        )
    return salt


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. FINISHED_STOPPED to FINISHED_ERROR are final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    # Its KV is arriving from a lower tier (scheduler/kv_connector.py): neither waiting nor
    # running; its device blocks are reserved and it is admitted when the load lands.
    LOADING_KV = 8

    @property
    def is_finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self)


# The final statuses and the finish reason each reports (a request is finished iff it has one).
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What one generation asks of an engine: the message, immutable once built.

    The ingress and the offline LLM build it; it crosses to a replica whole (the fleet router
    reads it as ``pending_request.args[0]``) and an engine turns it into its own `Request`, the
    scheduler's state of it. Every check of a request's own fields is made here, once.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # end-of-turn ids (an engine fills in the model's)
    priority: int = 0  # lower is more urgent
    tenant: str = "default"
    # Chained hashes of the prompt's full blocks (block size of the deployment), computed in the
    # ingress so the fleet router can estimate prefix-cache affinity without tokenizing.
    block_hashes: list[int] = field(default_factory=list)
    # Outputs already emitted elsewhere (a request resumed after its replica failed): they count
    # as outputs for penalties, stops and max_tokens; their KV is recomputed like the prompt's.
    output_token_ids: list[int] = field(default_factory=list)
    # The Ray actor name of the caller (an ingress replica): when that actor dies, the replica
    # aborts the request instead of generating for nobody. None: not watched (e.g. a driver).
    caller: str | None = None
    # The LoRA adapter the request runs under (EngineCore.add_lora names them); None: the base
    # model. Its block hashes are keyed by it (hash_prompt_blocks(..., lora_name=...)).
    lora_name: str | None = None
    # Set by the engine (engine/loras.py), whatever the sender put: `name@digest` of the adapter's
    # bytes. The prefix-cache chain is keyed by it (lora_key), so weights reloaded under the same
    # name never meet the old weights' KV.
    lora_identity: str | None = None
    # Keys the first block's hash (hash_prompt_blocks(..., salt=...)): requests of other salts
    # never share prefix-cache blocks, in any KV tier. None: unsalted (shared with all unsalted).
    cache_salt: str | None = None
    # Images as the sender passes them (PIL images), one placeholder token each in
    # prompt_token_ids; the engine expands them (engine/multimodal.py) into `mm_inputs`.
    images: tuple[ImageLike, ...] = ()
    # Set by the engine, whatever the sender put: the expanded prompt's image spans and pixel
    # arrays (scheduler/multimodal.py).
    mm_inputs: MultiModalInputs | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id: must be a non-empty string")
        self._check_images()
        self._check_cache_keys()
        if not (
            isinstance(self.priority, int)
            and not isinstance(self.priority, bool)
            and -MAX_PRIORITY <= self.priority <= MAX_PRIORITY
        ):
            raise ValueError(
                f"priority: must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got "
                f"{self.priority!r}"
            )
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS:
            raise ValueError(f"tenant: must be a string of at most {MAX_TENANT_CHARS} characters")
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: request {self.request_id!r} has an empty prompt")
        if len(self.output_token_ids) >= self.sampling_params.max_tokens:
            raise ValueError(
                f"output_token_ids: a resumed request must have fewer than max_tokens="
                f"{self.sampling_params.max_tokens} outputs, got {len(self.output_token_ids)}"
            )

    def _check_cache_keys(self) -> None:
        """What seeds the request's block hashes: its adapter (name and the engine's identity of
        its files) and its cache salt."""
        if self.lora_name is not None:
            check_lora_name(self.lora_name)
        if self.lora_identity is not None:
            if self.lora_name is None:
                raise ValueError("lora_identity: set by the engine for a request with a lora_name")
            check_lora_identity(self.lora_identity, self.lora_name)
        if self.cache_salt is not None:
            check_cache_salt(self.cache_salt)

    def _check_images(self) -> None:
        if not isinstance(self.images, tuple) or len(self.images) > MAX_IMAGES_PER_REQUEST:
            raise ValueError(f"images: must be a tuple of at most {MAX_IMAGES_PER_REQUEST} images")
        if self.mm_inputs is not None:
            if self.images:
                raise ValueError("images: a request carries raw images or mm_inputs, not both")
            if not isinstance(self.mm_inputs, MultiModalInputs):
                raise ValueError("mm_inputs: must be MultiModalInputs")
            self.mm_inputs.check(len(self.prompt_token_ids))

    @property
    def lora_key(self) -> str | None:
        """What the prefix-cache chain is keyed by: the adapter's identity, or its name before the
        engine set one (None: the base model)."""
        return self.lora_identity or self.lora_name


@dataclass(slots=True, eq=False)
class Request:
    """The scheduler's state of one sequence: its spec, and the progress made on it."""

    spec: EngineRequest
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    # The outputs so far (a resumed request starts with the spec's), and prompt + outputs.
    output_token_ids: list[int] = field(init=False)
    all_token_ids: list[int] = field(init=False)
    # Chained hashes of the full blocks of all_token_ids; grown lazily by the KV cache manager.
    block_hashes: list[int] = field(init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int | None = field(default=None, init=False)  # prefix hit at first admission
    num_preemptions: int = field(default=0, init=False)
    # How many of all_token_ids the model runner already holds (the rest travel in the next step).
    num_synced_tokens: int = field(default=0, init=False)
    # True once the runner has been sent this request's NewRequestData.
    known_to_runner: bool = field(default=False, init=False)
    # Tokens being sampled by steps in flight, not yet appended (async scheduling; 0 otherwise).
    num_output_placeholders: int = field(default=0, init=False)
    # The length probe's input: its prompt's last hidden state, projected (None: not extracted,
    # or not valid; scheduler/length_live.py).
    length_feature: list[float] | None = field(default=None, init=False)
    # The spec's fields the step reads for every request, copied once (the spec is frozen): an
    # attribute read instead of a property call per request per step (bench/scheduler_overhead.py).
    request_id: str = field(init=False)
    sampling_params: SamplingParams = field(init=False)
    eos_token_ids: tuple[int, ...] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    # Its prompt and max_tokens outputs: the token count that caps it (the outputs are
    # all_token_ids past the prompt), so the stop check reads one length (scheduler/stop.py).
    max_num_tokens: int = field(init=False)
    # The token ids that end it when sampled: its stop_token_ids, and the EOS ids unless
    # ignore_eos (scheduler/stop.py reads it).
    stop_ids: frozenset[int] = field(init=False)
    # Its images' token spans (scheduler/multimodal.py); () for text alone.
    image_spans: tuple[ImageSpan, ...] = field(init=False)

    def __post_init__(self) -> None:
        spec = self.spec
        params = self.sampling_params = spec.sampling_params
        self.request_id = spec.request_id
        self.eos_token_ids = spec.eos_token_ids
        eos = () if params.ignore_eos else spec.eos_token_ids
        self.stop_ids = frozenset((*params.stop_token_ids, *eos))
        self.num_prompt_tokens = len(spec.prompt_token_ids)
        self.max_num_tokens = self.num_prompt_tokens + params.max_tokens
        self.output_token_ids = list(spec.output_token_ids)
        self.all_token_ids = list(spec.prompt_token_ids) + self.output_token_ids
        mm = spec.mm_inputs
        self.image_spans = mm.spans if mm is not None else ()
        # The sender's hashes know no image digests: a prompt with images is hashed here.
        self.block_hashes = [] if self.image_spans else list(spec.block_hashes)
        self.num_synced_tokens = len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.spec.prompt_token_ids

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    @property
    def lora_name(self) -> str | None:
        return self.spec.lora_name

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
