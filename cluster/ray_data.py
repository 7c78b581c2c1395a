"""Ray Data batch inference: raylm engines as an actor-pool stage over a `ray.data.Dataset`.

    ds = ray.data.read_parquet(...)                      # rows with a "prompt" (or "messages")
    ds = map_generations(ds, GenerationStage(model=..., sampling_params=SamplingParams(...)))
    ds.write_parquet(...)                                # the rows, plus generation_* columns

Each actor of the pool holds one offline engine (engine/llm.py `LLM`; tensor parallelism through
its executor, within the actor's GPUs) and runs every batch it is handed through `LLM.generate` or
`LLM.chat`: one implementation of prompt encoding, chat templates, sampling, structured output
and stop strings, shared with the served path. docs/ray_data.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from scheduler.sampling_params import SamplingParams
from settings import shown

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

    from engine.llm import GenerationOutput

MAX_BATCH_SIZE = 65536  # rows one actor runs in one engine call
MAX_ACTORS = 4096  # engines in one pool
MAX_RESOURCE = 1024.0  # CPUs or GPUs one actor asks for
MAX_COLUMN_CHARS = 256
# What each generation adds, after the output prefix: "generation_text", ...
OUTPUT_SUFFIXES = ("text", "token_ids", "num_tokens", "finish_reason")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_resource(value: object) -> bool:
    """A finite number of CPUs or GPUs in [0, MAX_RESOURCE]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and 0 <= value <= MAX_RESOURCE
    except OverflowError:  # an int past the float range
        return False


def _check_column(value: object, field_name: str) -> None:
    _check(
        isinstance(value, str) and 0 < len(value) <= MAX_COLUMN_CHARS,
        field_name,
        f"must be a column name of 1 to {MAX_COLUMN_CHARS} characters, got {shown(value)}",
    )


@dataclass(frozen=True, slots=True)
class GenerationStage:
    """One generation stage: the engine each actor holds, what it reads and adds, the pool.

    Exactly one of `prompt_column` (text, or a list of token ids) and `messages_column` (a chat:
    a list of {"role", "content"} rows, rendered by the model's chat template) is read. Each row
    gains `<output_prefix>_text`, `_token_ids`, `_num_tokens` and `_finish_reason`.
    `concurrency` is a fixed pool size, or (min, max) for a pool that Ray Data scales.
    """

    model: str
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # LLM(...)'s settings by name
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    output_prefix: str = "generation"
    batch_size: int = 64
    concurrency: int | tuple[int, int] = 1
    num_cpus: float = 1.0  # per actor
    num_gpus: float = 0.0  # per actor: tensor_parallel_size on CUDA, so every rank has its GPU

    def __post_init__(self) -> None:
        self._check_columns()
        self._check_pool()
        _check(
            isinstance(self.sampling_params, SamplingParams),
            "sampling_params",
            f"must be a SamplingParams, got {type(self.sampling_params).__name__}",
        )
        _check(
            self.sampling_params.n == 1,
            "sampling_params.n",
            f"one generation per row, got n={self.sampling_params.n}; repeat the rows instead",
        )
        _check(isinstance(self.engine_kwargs, dict), "engine_kwargs", "must be a dict")
        self.engine_config()  # a bad engine setting is the caller's ValueError now, not an actor's

    def _check_columns(self) -> None:
        _check(
            (self.prompt_column is None) != (self.messages_column is None),
            "prompt_column",
            "exactly one of prompt_column and messages_column must be set, got "
            f"{shown(self.prompt_column)} and {shown(self.messages_column)}",
        )
        for name in ("prompt_column", "messages_column"):
            if getattr(self, name) is not None:
                _check_column(getattr(self, name), name)
        _check_column(self.output_prefix, "output_prefix")
        _check(
            self.input_column not in self.output_columns,
            "output_prefix",
            f"the output column {self.input_column!r} would overwrite the input column",
        )

    def _check_pool(self) -> None:
        _check(
            _is_int(self.batch_size) and 1 <= self.batch_size <= MAX_BATCH_SIZE,
            "batch_size",
            f"must be an integer in [1, {MAX_BATCH_SIZE}], got {shown(self.batch_size)}",
        )
        sizes = self.concurrency if isinstance(self.concurrency, tuple) else (self.concurrency,)
        _check(
            len(sizes) in (1, 2)
            and all(_is_int(n) and 1 <= n <= MAX_ACTORS for n in sizes)
            and sizes[0] <= sizes[-1],
            "concurrency",
            f"must be an integer in [1, {MAX_ACTORS}] or a (min, max) pair of them with "
            f"min <= max, got {shown(self.concurrency)}",
        )
        for name in ("num_cpus", "num_gpus"):
            _check(
                _is_resource(getattr(self, name)),
                name,
                f"must be a number in [0, {MAX_RESOURCE:g}], got {shown(getattr(self, name))}",
            )

    @property
    def input_column(self) -> str:
        return self.prompt_column if self.prompt_column is not None else str(self.messages_column)

    @property
    def output_columns(self) -> list[str]:
        return [f"{self.output_prefix}_{suffix}" for suffix in OUTPUT_SUFFIXES]

    def engine_config(self) -> EngineConfig:
        """The engine's settings, validated as LLM(...) validates them."""
        return EngineConfig.from_kwargs(model=self.model, **self.engine_kwargs)


class GenerationActor:
    """The callable class of the actor pool: one engine, built once per actor, run per batch."""

    def __init__(self, stage: GenerationStage) -> None:
        import cluster.ray_executor  # noqa: F401  (registers the `ray` executor backend)
        from engine.llm import LLM

        self.stage = stage
        self.llm = LLM(model=stage.model, **stage.engine_kwargs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        stage = self.stage
        clash = set(stage.output_columns) & set(batch.column_names)
        _check(not clash, "output_prefix", f"the dataset already has columns {sorted(clash)}")
        _check(
            stage.input_column in batch.column_names,
            "prompt_column" if stage.prompt_column is not None else "messages_column",
            f"no column {stage.input_column!r} in the dataset ({batch.column_names})",
        )
        rows = batch.column(stage.input_column).to_pylist()
        outputs = self._generate(rows)
        for name, values in zip(stage.output_columns, _output_values(outputs)):
            batch = batch.append_column(name, _array(values))
        return batch

    def _generate(self, rows: list[Any]) -> list[GenerationOutput]:
        stage = self.stage
        for i, row in enumerate(rows):
            _check(row is not None and len(row) > 0, stage.input_column, f"row {i} is empty")
        if stage.prompt_column is not None:
            prompts = [r if isinstance(r, str) else [int(t) for t in r] for r in rows]
            return self.llm.generate(prompts, stage.sampling_params, use_tqdm=False)
        return self.llm.chat(rows, stage.sampling_params, use_tqdm=False)

    def __del__(self) -> None:
        # An actor that Ray Data retires gives its engine's ranks and placement group back now.
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _output_values(outputs: list[GenerationOutput]) -> list[list[Any]]:
    """The output columns' values, in OUTPUT_SUFFIXES order."""
    return [
        [o.text for o in outputs],
        [list(o.token_ids) for o in outputs],
        [len(o.token_ids) for o in outputs],
        [o.finish_reason for o in outputs],
    ]


def _array(values: list[Any]) -> pa.Array:
    import pyarrow as pa

    if values and isinstance(values[0], list):
        return pa.array(values, type=pa.list_(pa.int64()))
    return pa.array(values)


def map_generations(ds: Dataset, stage: GenerationStage) -> Dataset:
    """`ds` with a generation per row, run by an actor pool of `stage.concurrency` engines."""
    from ray.data import ActorPoolStrategy

    sizes = stage.concurrency if isinstance(stage.concurrency, tuple) else (stage.concurrency,) * 2
    return ds.map_batches(
        GenerationActor,
        fn_constructor_kwargs={"stage": stage},
        compute=ActorPoolStrategy(min_size=sizes[0], max_size=sizes[1]),
        batch_size=stage.batch_size,
        batch_format="pyarrow",
        num_cpus=stage.num_cpus,
        num_gpus=stage.num_gpus,
    )
