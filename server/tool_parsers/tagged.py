"""Calls written as tagged blocks in free text: `... OPEN body CLOSE ...` (Hermes, Qwen3's
XML). The format supplies the body reader; this module finds the blocks and keeps the text
around them as content.

    text so far                                   content      calls
    'Sure. <tool_c'                               'Sure.'      []           (tag may follow)
    'Sure. <tool_call>{"name": "f", "argum'       'Sure.'      [f, '']
    'Sure. <tool_call>{"name": "f", "arguments": {"a": 1'
                                                  'Sure.'      [f, '{"a": 1']
    ... '}}</tool_call> Done'  (final)            'Sure. Done' [f, '{"a": 1}']

A block whose body the reader refuses (no name) is content. Text around calls loses the
whitespace that touches them (pieces on both sides are joined by one space); with no call
at all the content is the text unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from server.tool_parsers.base import Parsed, ParsedCall, join_content, without_partial
from server.tool_parsers.json_scan import NotJson, Pending

# body reader: (text, index of the body, final) -> (the call, index where reading stopped);
# raises Pending while the call's name is unread, NotJson (with `at`: where reading stopped)
# for a body that is no call.
BodyReader = Callable[[str, int, bool], tuple[ParsedCall, int]]


class TaggedCalls:
    def __init__(self, open_tag: str, close_tag: str, read_body: BodyReader) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.read_body = read_body

    def parse(self, text: str, final: bool) -> Parsed:
        segments: list[str | None] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                tail = text[pos:]
                segments.append(tail if final else without_partial(tail, (self.open_tag,)))
                break
            body = start + len(self.open_tag)
            call: ParsedCall | None
            try:
                call, read = self.read_body(text, body, final)
            except Pending:
                if final:  # it never became a call: the block is content
                    call, read = None, len(text)
                else:
                    segments.append(text[pos:start])
                    break
            except NotJson as failed:
                call, read = None, failed.at
            # The block ends at the first CLOSE after what was read (one inside a string of
            # the call is the call's text, not its end).
            end = text.find(self.close_tag, max(read, body))
            block_end = len(text) if end < 0 else end + len(self.close_tag)
            if call is None:
                segments.append(text[pos:block_end])
            else:
                calls.append(call)
                segments += [text[pos:start], None]
            if end < 0:
                break
            pos = block_end
        return Parsed(join_content(segments, final), calls)
