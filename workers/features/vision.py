"""Images as a runner feature: the vision tower runs for the images in this step's chunks, its
outputs are kept by image digest, and the rows are spliced over the placeholder tokens.

A request's images arrive once, with its NewRequestData (scheduler/multimodal.py); they are held
until it finishes, so a preempted request that recomputes can encode them again. The encoder
cache is an LRU bounded in bytes, keyed by the image's content digest: a conversation's second
turn with the same image (or another request with it) reads the cached rows instead of encoding
(`hits`). The scheduler never cuts a chunk inside an image, so a chunk holds whole images, or the
tail of one after a prefix-cache hit: the rows of the positions in the chunk are spliced.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Protocol

import torch

from scheduler.multimodal import ImageInput, ImageStepStats, PackedArray
from scheduler.outputs import ModelRunnerOutput, NewRequestData
from workers.features.base import RunnerContext, RunnerFeature
from workers.models.image_splice import ImageSplice
from workers.step_state import Batch, RequestState

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


class VisionLM(Protocol):
    """What a vision-language model offers the feature (workers/models/llava.py)."""

    image_splice: ImageSplice

    def encode_image(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor: ...


class StepPositions(Protocol):
    """A family's own positions for requests with images (M-RoPE: workers/layers/mrope.py)."""

    def start(self, new: NewRequestData) -> None: ...

    def finish(self, req_id: str) -> None: ...

    def prepare(self, batch: Batch) -> bool: ...


def is_vision_model(model: object) -> bool:
    return hasattr(model, "encode_image") and hasattr(model, "image_splice")


class EncoderCache:
    """Encoder outputs by image digest, least recently used dropped first past max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, digest: str) -> torch.Tensor | None:
        rows = self.entries.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(digest)
        return rows

    def put(self, digest: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return  # larger than the whole cache: used for this step only
        self.entries[digest] = rows
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


class VisionFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        if getattr(ctx.model, "images_attend_both_ways", False):
            refuse_one_way_attention(ctx.config.attention_backend, ctx.config.batch_invariant)
        self.model: VisionLM = ctx.model  # type: ignore[assignment]  # is_vision_model checked
        self.device = ctx.device
        self.images: dict[str, tuple[ImageInput, ...]] = {}
        # encoder_cache_gb (a 576-token LLaVA-1.5 image at 4096 wide in bf16 is 4.5 MiB).
        self.cache = EncoderCache(ctx.config.encoder_cache_bytes)
        self.step = ImageStepStats()  # this step's counts, handed out with its output
        self.failed: dict[str, str] = {}  # request id -> why its images failed this step
        # Qwen2.5-VL lays image tokens on a 3-axis grid: it sets a step's positions itself.
        self.positions: StepPositions | None = getattr(ctx.model, "step_positions", None)

    def start(self, new: NewRequestData, state: RequestState) -> None:
        if new.mm_inputs is not None:
            self.images[new.req_id] = new.mm_inputs.images
        if self.positions is not None:
            self.positions.start(new)

    def finish(self, req_id: str) -> None:
        self.images.pop(req_id, None)
        if self.positions is not None:
            self.positions.finish(req_id)

    def prepare(self, batch: Batch) -> bool:
        """The step's image rows set on the model's splice; True (run eagerly) when there are
        any."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for rid, start, n in zip(batch.req_ids, batch.starts, batch.query_lens):
            images = self.images.get(rid)
            if images:
                try:
                    self._request_rows(images, start, n, offset, rows, parts, spans)
                except Exception as exc:  # this request's images fail it, not the step
                    logger.warning("request %s: its images failed to encode: %r", rid, exc)
                    self.failed[rid] = f"images: {exc}"
            offset += n
        eager = self.positions is not None and self.positions.prepare(batch)
        if not parts:
            return eager
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.model.image_splice.set(index, torch.cat(parts), spans)
        return True

    def _request_rows(
        self,
        images: tuple[ImageInput, ...],
        start: int,
        n: int,
        offset: int,
        rows: list[int],
        parts: list[torch.Tensor],
        spans: list[tuple[int, int]],
    ) -> None:
        """Add one request's image rows in its chunk [start, start + n), which sits at `offset`
        in the step's tokens, and each image's flat range; nothing when one of its images
        fails."""
        mine_spans: list[tuple[int, int]] = []
        mine: list[torch.Tensor] = []
        for image in images:
            lo, hi = max(start, image.span.offset), min(start + n, image.span.end)
            if lo < hi:
                embeds = self._embeddings(image)
                mine.append(embeds[lo - image.span.offset : hi - image.span.offset])
                mine_spans.append((offset + lo - start, offset + hi - start))
        rows += [row for lo, hi in mine_spans for row in range(lo, hi)]
        spans += mine_spans
        parts += mine

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """The step's counts go out with its output (the scheduler sums them for the stats);
        requests whose images failed are failed alone (their rows ran with the placeholder's
        embedding: the scheduler finishes them before any of their blocks is cached)."""
        if self.failed:
            output.failed.update(self.failed)
            self.failed = {}
        if self.step.encoded or self.step.cache_hits:
            output.image_stats, self.step = self.step, ImageStepStats()

    def _embeddings(self, image: ImageInput) -> torch.Tensor:
        """The image's rows: cached by digest, else encoded now."""
        span = image.span
        rows = self.cache.get(span.digest)
        if rows is None:
            t0 = time.perf_counter()
            arrays = {name: unpack(a, self.device) for name, a in image.arrays}
            rows = self.model.encode_image(arrays)
            self.step.encoder_us += int((time.perf_counter() - t0) * 1e6)
            self.step.encoded += 1
            self.cache.put(span.digest, rows)
        else:
            self.step.cache_hits += 1
        if rows.shape[0] != span.length:
            raise ValueError(
                f"images: the tower gave {rows.shape[0]} rows for an image of {span.length} tokens"
            )
        return rows


def refuse_one_way_attention(backend: str, batch_invariant: bool) -> None:
    """At start, for a model whose image tokens attend to each other both ways (Gemma 3): the
    settings whose attention cannot (ValueError naming the setting), so no step fails later."""
    if backend == "flash_attn":
        raise ValueError(
            "attention_backend: flash_attn cannot attend an image's tokens both ways "
            "(Gemma 3); use auto, triton or torch"
        )
    if batch_invariant:
        raise ValueError(
            "batch_invariant: runs every token as its own decode row, which cannot attend an "
            "image's later tokens (Gemma 3)"
        )


def unpack(array: PackedArray, device: torch.device) -> torch.Tensor:
    """A PackedArray as a tensor on device (one copy from the bytes)."""
    flat = torch.frombuffer(bytearray(array.data), dtype=_TORCH_DTYPES[array.dtype])
    return flat.view(array.shape).to(device)
