"""What reading a streamed answer costs the gateway: each tool-call format (behind the Qwen3
reasoning parser) re-reads the choice's whole text on every delta, so the cost per delta
grows with the answer. This measures it on the worst case, a long answer with no call.

    python benchmarks/tool_parsers.py [--tokens 4000]

Reports, per format, the total and the per-delta time for --tokens deltas of one word
each, after 500 words of thinking. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import time

from server.chat_output import ChoiceReader
from server.reasoning import FORMATS as REASONING
from server.tool_parsers import FORMATS
from server.tools import Tool, plan_tools

TOOL = Tool.model_validate(
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
)


def measure(name: str, num_tokens: int) -> tuple[float, int]:
    """Seconds to stream `num_tokens` one-word deltas through the format; the text's size."""
    fmt = FORMATS[name]()
    reader = ChoiceReader(REASONING["qwen3"], "maybe", plan_tools([TOOL], "auto", None, fmt, ""))
    text = "<think>" + "hmm " * 500 + "</think>\n\n"
    words = [f"word{i % 97} " for i in range(num_tokens)]
    start = time.perf_counter()
    for word in words:
        text += word
        reader.deltas(text, final=False)
    reader.deltas(text, final=True)
    return time.perf_counter() - start, len(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    print(f"{'format':12s} {'deltas':>7s} {'chars':>7s} {'total ms':>9s} {'us/delta':>9s}")
    for name in sorted(FORMATS):
        seconds, size = measure(name, args.tokens)
        per = seconds / args.tokens * 1e6
        print(f"{name:12s} {args.tokens:7d} {size:7d} {seconds * 1e3:9.0f} {per:9.1f}")


if __name__ == "__main__":
    main()
