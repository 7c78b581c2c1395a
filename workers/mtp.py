"""The multi-token-prediction proposer: DeepSeek-V3's MTP layer (workers/models/deepseek_mtp.py)
proposes k tokens a step from the model's own hidden states, verified exactly as a draft model's.

It is a draft model of one layer in everything but its inputs (workers/draft.py: its paged KV in
the model's block ids, scratch blocks past the pool for the chain, rank 0 only, greedy proposals
that verification keeps exact): position i reads the model's final hidden state h_i and the next
token t_{i+1}. So a step that computed the model's positions [s, e) catches the MTP up over the
same positions, fed t_{s+1} .. t_e (t_e is the token sampled, or the prompt's next one) and the
step's hidden states; every position the model computes is thus covered in the step that computed
it, and the hidden states need not be kept. The catch-up's last output proposes t_{e+1}; each of
k - 1 one-token steps then feeds the token proposed last with the MTP's own output at the
position before (vLLM's chaining of one MTP layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig

from workers.draft import DraftModel, ProposerSetup
from workers.loader import iterate_weights
from workers.models.deepseek_mtp import DeepseekMTP
from workers.parallel import single_rank


@dataclass(slots=True)
class MTPRow:
    """One request of a step, as the MTP layer sees it."""

    next_tokens: list[int]  # t_{start+1} .. t_end
    hidden: torch.Tensor  # [end - start, hidden]: the model's hidden states at [start, end)
    start: int  # the MTP's KV holds positions [0, start)
    end: int
    block_ids: list[int]
    num_proposed: int  # tokens to propose after t_end (0: catch up only)


class MTPModel(DraftModel):
    """Rank 0's MTP layer, its paged KV and the proposal chain."""

    def __init__(self, model_dir: str, setup: ProposerSetup) -> None:
        with single_rank():
            model = build_mtp(model_dir, setup.dtype, setup.device, setup.max_model_len)
        self._bind(model, setup)

    def propose_mtp(self, rows: list[MTPRow]) -> list[list[int]]:
        """Catch every row up, then propose for the rows that ask; per row, its proposal."""
        proposals: list[list[int]] = [[] for _ in rows]
        ask = [i for i, r in enumerate(rows) if r.num_proposed > 0]
        if len(ask) > self.max_rows:
            raise ValueError(f"num_proposed: {len(ask)} rows propose, at most {self.max_rows} may")
        tables = self._tables(rows, ask)  # type: ignore[arg-type]
        feed = [i for i, r in enumerate(rows) if r.end > r.start]
        if not feed:
            return proposals
        feed.sort(key=lambda i: rows[i].end - rows[i].start != 1)  # one-token rows first
        tokens, out = self._run(
            [t for i in feed for t in rows[i].next_tokens],
            torch.cat([rows[i].hidden for i in feed]),
            [rows[i].start for i in feed],
            [rows[i].end - rows[i].start for i in feed],
            tables[feed],
        )
        last = dict(zip(feed, zip(tokens, out)))
        chain = [i for i in ask if i in last]
        for i in chain:
            proposals[i].append(last[i][0])
        self._chain(rows, chain, tables, last, proposals)
        return proposals

    def _chain(
        self,
        rows: list[MTPRow],
        chain: list[int],
        tables: torch.Tensor,
        last: dict[int, tuple[int, torch.Tensor]],
        proposals: list[list[int]],
    ) -> None:
        """k - 1 one-token steps over the proposing rows: each feeds the token proposed last and
        the MTP's own output at the position before."""
        for j in range(1, self.num_tokens):
            chain = [i for i in chain if rows[i].num_proposed > j]
            if not chain:
                break
            tokens, out = self._run(
                [proposals[i][-1] for i in chain],
                torch.stack([last[i][1] for i in chain]),
                [rows[i].end - 1 + j for i in chain],
                [1] * len(chain),
                tables[chain],
            )
            for i, token, m in zip(chain, tokens, out):
                proposals[i].append(token)
                last[i] = (token, m)

    def _run(
        self,
        tokens: list[int],
        hidden: torch.Tensor,
        starts: list[int],
        query_lens: list[int],
        tables: torch.Tensor,
    ) -> tuple[list[int], torch.Tensor]:
        """The greedy token after each row's last position, and the MTP's output there."""
        meta, positions, input_ids, last = self._inputs(tokens, starts, query_lens, tables)
        with single_rank():
            out = self.model(input_ids, positions, meta, hidden.to(self.device))[last]
            logits = self.model.compute_logits(out)
        assert logits is not None  # rank 0 of 1 holds the whole vocabulary
        return logits.argmax(dim=-1).tolist(), out


def build_mtp(
    model_dir: str, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> DeepseekMTP:
    """The checkpoint's first MTP layer, built and loaded (every tensor of it, checked)."""
    config = AutoConfig.from_pretrained(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekMTP(config, max_model_len)
    finally:
        torch.set_default_dtype(previous)
    model.check_loaded(model.load_weights(iterate_weights(model_dir, False)))
    return model.eval()
