"""Where a hostile image request's time goes, served: the CPU time each process of the served
path (Serve's HTTP proxy, the ingress replica, the model replica, Serve's controller) spends per
request of each body of the hostile set, sent one after another by one client.

The tiny LLaVA app of bench/image_neighbour.py; beside the hostile set, two references: a 5 MB
text-only body (a body's transfer alone, refused for its length) and a one-token chat (Serve's
fixed cost of one request). CPU time comes from /proc (10 ms ticks), so each body is sent
`--repeat` times and the mean printed. Figures, never pass/fail.

    python bench/hostile_cost.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.image_neighbour import MAX_IMAGE_BYTES, MODEL, image_part, serve_model, user, write_model
from tests.frontend.hostile_images import hostile_urls

# Ray's process titles of the served path's processes.
TITLES = {
    "proxy": "ray::ProxyActor",
    "ingress": "ray::ServeReplica:vision:OpenAIIngress",
    "replica": "ray::ServeReplica:vision:LLMReplica",
    "controller": "ray::ServeController",
}


def processes() -> dict[str, psutil.Process]:
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        title = (p.info["cmdline"] or [""])[0]
        found.update({name: p for name, t in TITLES.items() if title.startswith(t)})
    return found


def bodies() -> list[tuple[str, bytes]]:
    """(name, JSON body): the hostile set in order, then the two references."""
    named = []
    for i, url in enumerate(hostile_urls(MAX_IMAGE_BYTES)):
        content = [{"type": "text", "text": "what?"}, image_part(url)]
        named.append(
            (f"hostile {i}", {"model": MODEL, "max_tokens": 1, "messages": [user(content)]})
        )
    text = [{"type": "text", "text": "x" * (5 << 20)}]
    named.append(("5 MB of text", {"model": MODEL, "max_tokens": 1, "messages": [user(text)]}))
    hi = [{"type": "text", "text": "hi"}]
    named.append(("one-token chat", {"model": MODEL, "max_tokens": 1, "messages": [user(hi)]}))
    return [(name, json.dumps(body).encode()) for name, body in named]


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--port", type=int, default=8018)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    url = serve_model(write_model(tempfile.mkdtemp(), 70), 16, args.port)
    procs = processes()
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=600, headers=headers) as client:
        client.post("/chat/completions", content=bodies()[-1][1])  # the replica's first step
        for name, body in bodies():
            before = cpu_seconds(procs)
            codes = {
                client.post("/chat/completions", content=body).status_code
                for _ in range(args.repeat)
            }
            after = cpu_seconds(procs)
            per = "  ".join(f"{k} {(after[k] - before[k]) / args.repeat * 1e3:5.1f}" for k in procs)
            print(f"{name:>15} {len(body):>9} B  status {sorted(codes)}  CPU ms per request: {per}")
    print(f"load average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
