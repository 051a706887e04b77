"""Reading JSON objects that a model is still writing (shared by the JSON-based formats).

`ObjectScanner` reads the top level of one object: the string values it has decoded
(`found`) and every value's raw text as the model wrote it (`raw`, partial for a value the
text cuts off). It raises `Pending` where the text ends and `NotJson` where it stops being
JSON; `i` is how far it read either way.
"""

from __future__ import annotations

import json

WS = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character from `i` (or the text's end)."""
    while i < len(text) and text[i] in WS:
        i += 1
    return i


class Pending(Exception):
    """The text ends before what is being read does."""


class NotJson(Exception):
    """The text is not (the start of) the JSON expected there; `at` is where reading
    stopped, when known."""

    def __init__(self, at: int = 0) -> None:
        super().__init__(at)
        self.at = at


class ObjectScanner:
    def __init__(self, text: str, start: int = 0) -> None:
        self.text = text
        self.i = start
        self.found: dict[str, object] = {}
        self.raw: dict[str, str] = {}

    def fields(self) -> None:
        """Reads one whole object from `i`; `i` ends just after its closing brace."""
        self.skip_ws()
        self._expect("{")
        while True:
            self.skip_ws()
            if self.peek() == "}":
                self.i += 1
                return
            key = self.string()
            self.skip_ws()
            self._expect(":")
            self.skip_ws()
            self._value(key)
            self.skip_ws()
            if self.peek() == ",":
                self.i += 1
            elif self.peek() == "}":
                self.i += 1
                return
            else:
                raise NotJson

    def peek(self) -> str:
        if self.i >= len(self.text):
            raise Pending
        return self.text[self.i]

    def skip_ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in WS:
            self.i += 1

    def _expect(self, char: str) -> None:
        if self.peek() != char:
            raise NotJson
        self.i += 1

    def string(self) -> str:
        start = self.i
        self._expect('"')
        while self.peek() != '"':
            if self.text[self.i] == "\\":
                self.i += 1
                self.peek()  # the escaped character: the text may end before it
            self.i += 1
        self.i += 1
        try:
            return str(json.loads(self.text[start : self.i]))
        except json.JSONDecodeError:
            raise NotJson from None

    def _value(self, key: str) -> None:
        start = self.i
        try:
            if self.peek() == '"':
                self.found[key] = self.string()
            else:
                self.skip_value()
        finally:
            self.raw[key] = self.text[start : self.i]

    def skip_value(self) -> None:
        """An object, array, number or literal; strings inside are skipped whole."""
        depth = 0
        while True:
            char = self.peek()
            if char == '"':
                self.string()
                if depth == 0:
                    return
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                if depth == 0:
                    return
                depth -= 1
            elif depth == 0 and (char in WS or char == ","):
                return
            self.i += 1
            if depth == 0 and char in "}]":
                return


def read_call(text: str, start: int, final: bool, names: tuple[str, ...]) -> tuple[str, str, int]:
    """The call object at `start`: its name, its arguments' raw text (the first of `names`
    present) and the index just past what was read. Raises Pending while the name is still
    unread, NotJson (with where reading stopped) when the object has no string name.

    Once the name has been read the object is a call, whatever follows (the decision never
    changes as the text grows); a cut-off call's arguments are what has been written."""
    scanner = ObjectScanner(text, start)
    whole = True
    try:
        scanner.fields()
    except Pending:
        whole = False
        if not final and not isinstance(scanner.found.get("name"), str):
            raise
    except NotJson:
        pass  # what follows the break cannot change what was read before it
    name = scanner.found.get("name")
    if not isinstance(name, str):
        raise NotJson(scanner.i)
    arguments = next((scanner.raw[k] for k in names if k in scanner.raw), None)
    if arguments is None:
        # A whole call without arguments takes none; a cut-off one has shown none yet.
        arguments = "{}" if whole else ""
    return name, arguments, scanner.i
