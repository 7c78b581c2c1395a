"""Contracts that cross the scheduler / model-runner boundary (plain, cheap to pickle)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, fields

from scheduler.kv_connector import KVTransfers
from scheduler.kv_events import KVEventTail
from scheduler.multimodal import ImageStepStats, MultiModalInputs
from scheduler.request import FINISH_REASONS, Request
from scheduler.sampling_params import SamplingParams
from scheduler.state_slots import StateCopies

# Per sampled token: (token_id, logprob) pairs, the sampled token first, then the top-N by rank.
TokenLogprobs = list[tuple[int, float]]


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen: sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (a prefix-cache hit) before this step
    output_token_ids: list[int] = field(default_factory=list)  # a resumed request's earlier outputs
    eos_token_ids: tuple[int, ...] = ()  # masked with stop_token_ids until min_tokens outputs
    # Its LoRA adapter (None: the base model); the runner finds the adapter's slot by name each
    # step, so a request resumed after its adapter moved slots reads the right one.
    lora_name: str | None = None
    # Its images' spans and pixel arrays (scheduler/multimodal.py), sent with it once; None: text.
    mm_inputs: MultiModalInputs | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the runner already holds, one column per field."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and is back; new_block_ids replaces its block table.
    resumed: list[bool] = field(default_factory=list)
    # Tokens appended since the runner last saw the request (the sampled ones, normally one).
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """What runs in one step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # (gpu_block, cpu_block) copies the runner performs before the forward: out first, then in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the proposed tokens each request verifies this step (they follow its
    # last token in the step's input and count in its num_scheduled_tokens)...
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # ...and the block tables cut back after rejected tokens gave their slots up: request id ->
    # blocks kept. Applied before this step's diffs.
    truncated_block_tables: dict[str, int] = field(default_factory=dict)
    # LoRA adapters to load into device slots before this step's forward: slot -> (name, path)
    # (scheduler/lora_slots.py). Every TP rank loads the same slots in the same step.
    lora_loads: dict[int, tuple[str, str]] = field(default_factory=dict)
    # KV copies to and from the lower tiers of the prefix cache (scheduler/kv_connector.py), run
    # around the swap copies; None when there are none.
    kv_transfers: KVTransfers | None = None
    # A hybrid model's recurrent-state checkpoint copies (scheduler/state_checkpoints.py); None
    # when its prefix caching is off or the model has no recurrent state.
    state_copies: StateCopies | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_copies(self) -> bool:
        """Whether the workers have blocks to copy in this step, tokens or not."""
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.kv_transfers)

    def encode(self) -> bytes:
        """The step for a TP worker: pickled as flat tuples, which costs half of pickling the
        dataclasses (a slots dataclass pickles through Python-level state calls)."""
        cached = self.scheduled_cached_reqs
        return pickle.dumps(
            (
                self.scheduled_new_reqs,
                tuple(getattr(cached, name) for name in _CACHED_FIELDS),
                tuple(getattr(self, name) for name in _STEP_REST),
            ),
            pickle.HIGHEST_PROTOCOL,
        )

    @classmethod
    def decode(cls, data: bytes | bytearray) -> SchedulerOutput:
        new_reqs, cached, rest = pickle.loads(data)
        return cls(new_reqs, CachedRequestData(*cached), *rest)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Tokens sampled in one step: one list per scheduled request, empty for a partial prefill."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Requests whose own inputs failed this step (sampling state, their sampler row): request id ->
    # reason. They are finished with an error; the step's other requests go on.
    failed: dict[str, str] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: request id -> the pooled, normalised
    # hidden state.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Requests that asked for prompt_logprobs and sampled their first token this step: one entry
    # per prompt token after the first (the token itself, then the alternatives).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Mixture-of-experts models: the (token, expert) rows each tensor-parallel rank computed this
    # step, summed over layers (the expert-parallel load balance); None for dense models.
    expert_tokens_per_rank: list[int] | None = None
    # Speculative decoding: per request, tokens proposed to follow what it sampled this step (the
    # scheduler decides how many of them the next step verifies). None: no proposer.
    spec_token_ids: list[list[int]] | None = None
    # Device blocks whose load from a lower tier failed its check this step (every rank agrees):
    # the scheduler recomputes from the first of a request's failed blocks.
    kv_load_failed: list[int] = field(default_factory=list)
    # The length probe's input (only when a length-aware setting is on): request id -> its
    # prompt's final hidden state at the last token, projected to a few floats
    # (workers/length_features.py), sent once, in the step that ends the prompt.
    length_features: dict[str, list[float]] = field(default_factory=dict)
    # Vision models: what the tower did this step (scheduler/features_images.py sums it).
    image_stats: ImageStepStats | None = None

    def encode(self) -> bytes:
        """Rank 0's answer as one pickled tuple (see SchedulerOutput.encode)."""
        return pickle.dumps(
            tuple(getattr(self, name) for name in _RUNNER_OUTPUT_FIELDS), pickle.HIGHEST_PROTOCOL
        )

    @classmethod
    def decode(cls, data: bytes | bytearray) -> ModelRunnerOutput:
        return cls(*pickle.loads(data))


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # why the request failed (finish_reason "error"); for logs only
    pooled: list[float] | None = None  # an embedding request's vector (SamplingParams.pooling)
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first token, when asked for
    # A served request's last output: its replica's newest KV events, for the ingress's router
    # (cluster/kv_event_pub.py); None on every other output.
    kv_events: KVEventTail | None = None


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of queue lengths and KV-cache figures."""

    num_waiting: int
    num_running: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_free_blocks: int = 0
    num_prompt_tokens_queried: int = 0
    num_prompt_tokens_hit: int = 0
    num_gpu_blocks: int = 0  # the KV pool's size: the router bounds its index of this replica by it
    # Speculative decoding, cumulative: proposed tokens verified, those accepted, and verify rows
    # (accepted / rows is the mean accepted length; each row also yields one token of its own).
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verify_rows: int = 0
    # The LoRA adapters in device slots (least recently used first), for adapter-affinity routing.
    loaded_loras: tuple[str, ...] = ()
    # Every registered adapter's identity (name@digest), which keys its prefix-cache chain: the
    # ingress hashes an adapter request's prompt under it for prefix-affinity routing.
    lora_identities: tuple[str, ...] = ()
    # Tokens the waiting requests still have to compute before they run (prompts, and a preempted
    # request's recompute): the backlog the autoscaling policy weighs (router/autoscaling.py).
    num_waiting_prompt_tokens: int = 0
    # The prefix cache's lower tiers (scheduler/kv_connector.py): blocks held now, and cumulative
    # blocks saved from the device pool, loaded back intact, and failed loads (recomputed).
    num_cpu_tier_blocks: int = 0
    num_disk_tier_blocks: int = 0
    num_tier_saved_blocks: int = 0
    num_tier_loaded_blocks: int = 0
    num_tier_failed_loads: int = 0
    # Vision models, cumulative (scheduler/features_images.py): images the tower encoded, images
    # read from its encoder cache instead, and the tower's time in microseconds.
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time_us: int = 0


# Field order of the encoded tuples (positional, so they follow the dataclasses as they change);
# a step's rest is every field after the new and the cached requests.
_STEP_REST = tuple(f.name for f in fields(SchedulerOutput))[2:]
_CACHED_FIELDS = tuple(f.name for f in fields(CachedRequestData))
_RUNNER_OUTPUT_FIELDS = tuple(f.name for f in fields(ModelRunnerOutput))


def request_output(
    req: Request,
    new_token_ids: list[int],
    new_logprobs: list[TokenLogprobs] | None = None,
    error: str | None = None,
) -> RequestOutput:
    """The one place a RequestOutput is built: what req produced this step and where it stands.

    It runs per request per step, so it fills the slots itself: calling the class (its generated
    __init__ behind the type's call) costs about 100 ns more in CPython 3.11, some 5% of a decode
    step (bench/scheduler_overhead.py). tests/scheduler/test_decode_pass.py checks that every
    field is set."""
    reason = FINISH_REASONS.get(req.status)  # one dict read
    out = _new_object(RequestOutput)
    out.request_id, out.new_token_ids = req.request_id, new_token_ids
    out.finished, out.finish_reason = reason is not None, reason
    out.num_prompt_tokens, out.num_output_tokens = req.num_prompt_tokens, len(req.output_token_ids)
    out.num_cached_tokens = req.num_cached_tokens or 0  # None: never admitted
    out.new_logprobs, out.error = new_logprobs, error
    out.pooled = out.prompt_logprobs = out.kv_events = None
    return out


_new_object = object.__new__
