"""Write the arithmetic example's dataset: "What is a + b?" with a, b in 1..20.

Deterministic (fixed seed), so the shipped files can be regenerated
byte-for-byte: `python examples/arithmetic/make_data.py`. The held-out test
split shares no (a, b) pair with the training split.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SYSTEM = "You are a helpful assistant. Answer with the number."


def row(a: int, b: int) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ],
        "answer": str(a + b),
    }


def main() -> None:
    pairs = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    random.Random(1234).shuffle(pairs)
    test, train = pairs[:64], pairs[64:]
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    for name, split in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for a, b in split:
                handle.write(json.dumps(row(a, b)) + "\n")
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")


if __name__ == "__main__":
    main()
