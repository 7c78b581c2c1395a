"""How long the ingress's body parse holds the GIL for a chat with one large base64 image:
deploy/body.py's parse (pydantic-core's parser, then the schema) against json.loads of the same
bytes. Figures, never pass/fail.

    python bench/body_parse.py [--image-mb 4.2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deploy.body import _parsed
from deploy.fields import Ignored
from deploy.schemas import ChatCompletionRequest


def median_ms(f: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image-mb", type=float, default=4.2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    b64 = base64.b64encode(os.urandom(int(args.image_mb * 1e6))).decode()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()
    ours = median_ms(
        lambda: _parsed(raw, ChatCompletionRequest, 64, "reject", Ignored()), args.repeats
    )
    stdlib = median_ms(lambda: json.loads(raw), args.repeats)
    print(
        f"body {len(raw)} bytes: deploy/body.py parse + schema {ours:.2f} ms median, "
        f"json.loads alone {stdlib:.2f} ms ({stdlib / ours:.0f}x)"
    )


if __name__ == "__main__":
    main()
