"""Write the length evaluation set: prompts (bench/length_prompts.py) with the output lengths the
embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) gives them, greedy, up to --max-tokens.

    python -m bench.length_eval_set --num 600 --max-tokens 512 --out sim/traces/length_eval.jsonl

Every prompt runs in one batch through the offline LLM (chat template, temperature 0), so the
lengths are the model's own: an answer that reaches max_tokens is recorded at max_tokens with
finish_reason "length". --limit N generates only the first N (to time a run before a full one).
One JSON object a line: id, kind (also the tenant), messages, prompt_len (tokens after the chat
template), output_len, finish_reason; the first line is a header naming the command and model.
Chunks of --chunk prompts are appended as they complete; rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.length_prompts import eval_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.length_eval_set", description=__doc__)
    parser.add_argument("--num", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=0, help="generate only the first N")
    parser.add_argument("--out", default="sim/traces/length_eval.jsonl")
    # One thread: on a loaded 2-core machine two OpenMP threads spin at barriers (16 tokens took
    # 46 s with 2 threads and 3 s with 1 under a load average of 18).
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=100, help="prompts generated per batch")
    parser.add_argument("--shard", default="0/1", help="k/n: this process's share of the chunks")
    parser.add_argument("--merge", nargs="+", help="join these shard files into --out and stop")
    a = parser.parse_args(argv)
    if a.merge:
        merge(a.merge, a.out)
        return

    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    prompts = eval_prompts(a.num, a.seed)
    if a.limit:
        prompts = prompts[: a.limit]
    done = _done_ids(a.out)
    if not done:
        header = {
            "source": "python -m bench.length_eval_set "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": "SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default), float32, CPU",
            "sampling": f"greedy (temperature 0), max_tokens {a.max_tokens}, chat template",
        }
        with open(a.out, "w") as f:
            f.write(json.dumps({"header": header}) + "\n")
    # Shard k of n takes every n-th chunk from the k-th: n processes of one thread each share a
    # loaded machine's cores without OpenMP barriers; --merge joins their files in id order.
    k, n = (int(x) for x in a.shard.split("/"))
    todo = [(i, p) for i, p in enumerate(prompts) if i not in done and (i // a.chunk) % n == k]
    llm = LLM(cpu_threads=a.cpu_threads, quantization="none")  # recorded figures: fp32
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    # Chunks written as they complete (whole chunks only, so a stopped run biases no lengths); a
    # rerun with the same arguments resumes after the last complete chunk.
    for c in range(0, len(todo), a.chunk):
        chunk = todo[c : c + a.chunk]
        start = time.perf_counter()
        outs = llm.chat([p.messages for _, p in chunk], params, use_tqdm=False)
        took = time.perf_counter() - start
        total = sum(len(o.token_ids) for o in outs)
        print(
            f"prompts {chunk[0][0]}-{chunk[-1][0]}: {total} output tokens in {took:.1f} s"
            f" ({total / took:.1f} tok/s)",
            file=sys.stderr,
            flush=True,
        )
        with open(a.out, "a") as f:
            for (i, p), o in zip(chunk, outs):
                row = {
                    "id": i,
                    "kind": p.kind,
                    "messages": p.messages,
                    "prompt_len": len(o.prompt_token_ids),
                    "output_len": len(o.token_ids),
                    "finish_reason": o.finish_reason,
                }
                f.write(json.dumps(row) + "\n")
    llm.shutdown()


def merge(paths: list[str], out: str) -> None:
    """One file: the first shard's header (with every shard's command), then all rows by id."""
    headers, rows = [], []
    for path in paths:
        with open(path) as f:
            for line in f:
                obj = json.loads(line)
                (headers if "header" in obj else rows).append(obj)
    header = dict(headers[0]["header"])
    header["source"] = "; ".join(h["header"]["source"] for h in headers)
    rows.sort(key=lambda r: r["id"])
    with open(out, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _done_ids(path: str) -> set[int]:
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return set()
    return {r["id"] for r in rows if "id" in r}


if __name__ == "__main__":
    main()
