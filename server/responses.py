"""POST /v1/responses (OpenAI's Responses API) over the chat pipeline, with a store.

A request's items become a chat conversation: instructions the system turn, messages their
turns, a `function_call` an assistant tool call, a `function_call_output` a tool turn, a
`reasoning` item the thinking of the assistant turn after it. The chat pipeline (templates,
tools, reasoning and structured outputs) runs it, and its message comes back as output
items: reasoning, then the message, then one `function_call` per call. Streamed, the chat
deltas become the typed events (`response.output_text.delta`, ...), each item opened,
filled and closed in turn.

With `store` (the default) the response and the conversation before it are kept
(server/response_store.py), for GET, DELETE and `previous_response_id`; `background` runs
it after the reply, for GET to poll and /cancel to stop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from engine import LoRARequest
from server.body import from_validation_error, parse_body
from server.chat import create_chat_completion
from server.disconnect import cancel_on_disconnect
from server.errors import OpenAIError
from server.openapi import ResponseDeleted, ResponseItemList, ResponseObject, route_docs
from server.protocol import ChatCompletionRequest, ResponsesRequest
from server.response_store import ResponseStore, StoredResponse, open_store
from server.serving import Caller, ServingContext, admit

logger = logging.getLogger(__name__)

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
# Tool types of the Responses API that run on OpenAI's side; none runs here.
HOSTED_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer_use",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- request: items to a chat request ----------------------------------------------


def _field(item: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = item.get(name)
    if not isinstance(value, kind):
        raise OpenAIError(400, f"{where}.{name} must be a {kind.__name__}", f"{where}.{name}")
    return value


def _parts_text(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    """The text of a string or of a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where} must be a string or a list of parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise OpenAIError(
                400, f"{where}[{j}].type {kind!r} is not supported here", f"{where}[{j}].type"
            )
        texts.append(_field(part, "text" if kind != "refusal" else "refusal", str, f"{where}[{j}]"))
    return "".join(texts)


def normalise_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items in their full form (a string is one user message);
    raises a 400 naming an item this server cannot take."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [_input_text(raw)]}]
    items = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(
                    400, f"{where}.role {role!r} is not a message role", f"{where}.role"
                )
            allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _parts_text(item.get("content"), f"{where}.content", allowed)
            part = {"type": "output_text", "text": text, "annotations": []}
            items.append(
                {
                    "type": "message",
                    "role": role,
                    "content": [part if role == "assistant" else _input_text(text)],
                }
            )
        elif kind == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": _field(item, "call_id", str, where),
                    "name": _field(item, "name", str, where),
                    "arguments": _field(item, "arguments", str, where),
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            text = _parts_text(output, f"{where}.output", ("input_text",))
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": _field(item, "call_id", str, where),
                    "output": text,
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or []
            text = _parts_text(parts, f"{where}.content", ("reasoning_text",))
            items.append({"type": "reasoning", "content": [_reasoning_text(text)], "summary": []})
        else:
            raise OpenAIError(400, f"{where}.type {kind!r} is not supported", f"{where}.type")
    return items


def _input_text(text: str) -> dict[str, Any]:
    return {"type": "input_text", "text": text}


def _reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation the items make, as chat messages."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    thinking = None  # a reasoning item's text, for the assistant turn after it
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thinking = "".join(part["text"] for part in item["content"])
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)  # the same turn's calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"][0]["text"]})
        if thinking is not None and kind != "reasoning" and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning"] = thinking
            thinking = None
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            why = "runs on OpenAI's side" if kind in HOSTED_TOOLS else "is unknown"
            raise OpenAIError(
                400,
                f"tool type {kind!r} is not supported: it {why}; give function tools",
                f"tools[{i}].type",
            )
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise OpenAIError(400, f"unknown tool field {sorted(unknown)[0]!r}", f"tools[{i}]")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # the chat request checks the value
    if choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(400, "tool_choice must be none, auto, required or a function", "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown or text.get("verbosity") not in (None, "medium"):
        name = sorted(unknown)[0] if unknown else "verbosity"
        raise OpenAIError(400, f"text.{name} is not supported", f"text.{name}")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise OpenAIError(400, f"text.format.type {kind!r} is not supported", "text.format.type")


def _template_kwargs(ctx: ServingContext, reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """`reasoning.effort` reaches templates that read `reasoning_effort` (gpt-oss's); a
    template that reads none would ignore it, so it is refused there."""
    if not reasoning:
        return {}
    unknown = set(reasoning) - {"effort", "summary"}
    if unknown:
        name = sorted(unknown)[0]
        raise OpenAIError(400, f"reasoning.{name} is not supported", f"reasoning.{name}")
    if reasoning.get("summary") is not None:
        raise OpenAIError(400, "reasoning summaries are not generated here", "reasoning.summary")
    effort = reasoning.get("effort")
    if effort is None:
        return {}
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None) or ""
    if "reasoning_effort" not in template:
        raise OpenAIError(
            400, "this model's chat template takes no reasoning effort", "reasoning.effort"
        )
    return {"reasoning_effort": effort}


def chat_request(
    ctx: ServingContext, body: ResponsesRequest, items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "messages": chat_messages(body.instructions, items),
        "tools": _chat_tools(body.tools),
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user or body.safety_identifier,
        "chat_template_kwargs": _template_kwargs(ctx, body.reasoning) or None,
    }
    if body.stream:
        fields |= {"stream": True, "stream_options": {"include_usage": True}}
    data = {k: v for k, v in fields.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:  # a tool or a format the chat request cannot take
        raise from_validation_error(exc, data) from None


# ---- response: a chat message to output items ----------------------------------------


class Shape:
    """The response object's fields that echo the request, and its ids."""

    def __init__(self, ctx: ServingContext, body: ResponsesRequest, response_id: str) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        self.body = body
        self.model = body.model or ctx.model_name  # an adapter answers under its own name

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        body = self.body
        text = body.text or {}
        effort = (body.reasoning or {}).get("effort")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": bool(body.background),
            "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": effort, "summary": None},
            "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": [
                {"strict": None, "description": None, "parameters": None} | t
                for t in body.tools or []
            ],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
        }


def response_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": chat_usage["total_tokens"],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [_reasoning_text(text)],
        "status": status,
    }


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"], "completed"))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(
            call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    return items


def finished(shape: Shape, choice: dict[str, Any], chat_usage: dict[str, Any]) -> dict[str, Any]:
    output = output_items(choice["message"])
    incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
    status = "incomplete" if incomplete else "completed"
    return shape.response(status, output, response_usage(chat_usage), incomplete=incomplete)


# ---- the stream -----------------------------------------------------------------------


class EventStream:
    """Chat deltas to Responses events: items open as their first delta arrives and close
    when the next item opens or the choice ends."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # closed items, in order
        self.open: dict[str, Any] | None = None  # the item being filled
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        response = self.shape.response("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.open = item
        index = len(self.output)
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_output_text(""),
                )
            )
        return events

    def close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        events = []
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self.event("response.reasoning_text.done", **ids, content_index=0, text=text)
            )
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    **ids,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event("response.content_part.done", **ids, content_index=0, part=part)
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for field, item, prefix, make, kind, extra in _TEXT_DELTAS:
            text = delta.get(field)
            if not text:
                continue
            if self.open is None or self.open["type"] != item:
                events += self._open(make(new_id(prefix), "", "in_progress"))
            assert self.open is not None
            self.open["content"][0]["text"] += text
            events.append(
                self.event(
                    kind,
                    item_id=self.open["id"],
                    output_index=len(self.output),
                    content_index=0,
                    delta=text,
                    **extra,
                )
            )
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call["index"] not in self.calls:
                item = call_item(new_id("fc"), call["id"], function["name"], "", "in_progress")
                self.calls[call["index"]] = item
                events += self._open(item)
            item = self.calls[call["index"]]
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=len(self.output),
                        delta=function["arguments"],
                    )
                )
        return events


# A chat delta's text fields: the item each fills (its type, id prefix and maker) and the
# event each sends, with that event's extra fields.
_TextDelta = tuple[str, str, str, Callable[..., dict[str, Any]], str, dict[str, Any]]
_TEXT_DELTAS: tuple[_TextDelta, ...] = (
    ("reasoning", "reasoning", "rs", reasoning_item, "response.reasoning_text.delta", {}),
    ("content", "message", "msg", message_item, "response.output_text.delta", {"logprobs": []}),
)


async def stream_response(
    shape: Shape,
    chunks: AsyncIterator[dict[str, Any]],
    on_done: Any,
) -> AsyncIterator[dict[str, Any]]:
    """The events of one streamed response; `on_done(response)` is awaited with the final
    response object before its last event (to store it)."""
    events = EventStream(shape)
    for event in events.start():
        yield event
    finish_reason = None
    chat_usage = None
    try:
        async for chunk in chunks:
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for choice in chunk["choices"]:
                finish_reason = choice.get("finish_reason") or finish_reason
                for event in events.delta(choice["delta"]):
                    yield event
    except OpenAIError as exc:
        failed = shape.response("failed", events.output, error=_error(exc.message, "server_error"))
        await on_done(failed)
        yield events.event("response.failed", response=failed)
        return
    for event in events.close():
        yield event
    assert chat_usage is not None  # include_usage: the last chunk carries it
    incomplete = "max_output_tokens" if finish_reason == "length" else None
    response = shape.response(
        "incomplete" if incomplete else "completed",
        events.output,
        response_usage(chat_usage),
        incomplete=incomplete,
    )
    await on_done(response)
    kind = "response.incomplete" if incomplete else "response.completed"
    yield events.event(kind, response=response)


async def sse_response_events(
    events: AsyncIterator[dict[str, Any]],
) -> AsyncIterator[dict[str, str]]:
    """The Responses API's framing: each event named by its type, no [DONE]; a failure
    outside the engine's own ends the stream with an `error` event."""
    sequence = 0
    try:
        async for event in events:
            sequence = event["sequence_number"] + 1
            yield {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
    except Exception as exc:  # the client still learns why the stream ended
        logger.exception("response stream failed")
        error = {
            "type": "error",
            "sequence_number": sequence,
            "code": "server_error",
            "message": f"internal error: {exc!r}",
            "param": None,
        }
        yield {"event": "error", "data": json.dumps(error)}


def _error(message: str, code: str) -> dict[str, Any]:
    return {"code": code, "message": message}


# ---- the endpoints' work ----------------------------------------------------------------


class Responses:
    """The store (opened on first use), and the background responses running in this
    process."""

    def __init__(self, spec: str, ttl: float, cache_dir: Path) -> None:
        self._open = lambda: open_store(spec, ttl, cache_dir)
        self._store: ResponseStore | None = None
        self.running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.closing = False

    @property
    def store(self) -> ResponseStore:
        if self._store is None:
            self._store = self._open()
        return self._store

    async def close(self) -> None:
        """Stops the background responses (stored as failed: the server stopped), then the
        store."""
        self.closing = True
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._store is not None:
            await self._store.close()

    async def context(self, tenant: str, body: ResponsesRequest) -> list[dict[str, Any]]:
        """Every item before this turn's answer: the previous response's conversation and
        output, then this request's input."""
        items = normalise_items(body.input)
        if body.previous_response_id is None:
            return items
        previous = await self.store.get(tenant, body.previous_response_id)
        if previous is None:
            raise OpenAIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found.",
                "previous_response_id",
                code="previous_response_not_found",
            )
        earlier = previous.context + [_as_input(item) for item in previous.response["output"]]
        return earlier + items

    async def create(
        self, ctx: ServingContext, body: ResponsesRequest, caller: Caller
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        tenant = caller.tenant or ""
        items = await self.context(tenant, body)
        chat = chat_request(ctx, body, items)
        shape = Shape(ctx, body, new_id("resp"))
        store = body.store is not False

        async def save(response: dict[str, Any]) -> None:
            if store:
                await self.store.put(tenant, StoredResponse(response, items))

        if body.background:
            queued = shape.response("queued", [])
            await save(queued)
            task = asyncio.create_task(self._background(ctx, chat, caller, shape, save))
            key = (tenant, shape.id)
            self.running[key] = task
            task.add_done_callback(lambda _: self.running.pop(key, None))
            return queued
        result = await create_chat_completion(ctx, chat, caller)
        if isinstance(result, dict):
            response = finished(shape, result["choices"][0], result["usage"])
            await save(response)
            return response
        return stream_response(shape, result, save)

    async def _background(
        self,
        ctx: ServingContext,
        chat: ChatCompletionRequest,
        caller: Caller,
        shape: Shape,
        save: Any,
    ) -> None:
        try:
            await save(shape.response("in_progress", []))
            result = await create_chat_completion(ctx, chat, caller)
            assert isinstance(result, dict)  # not streamed
            await save(finished(shape, result["choices"][0], result["usage"]))
        except asyncio.CancelledError:
            if self.closing:
                error = _error("the server stopped before the response finished", "server_error")
                await save(shape.response("failed", [], error=error))
            else:
                await save(shape.response("cancelled", []))
        except OpenAIError as exc:
            await save(shape.response("failed", [], error=_error(exc.message, "server_error")))
        except Exception as exc:  # a background failure is stored, not raised
            logger.exception("background response %s failed", shape.id)
            await save(shape.response("failed", [], error=_error(repr(exc), "server_error")))
        finally:
            caller.ticket.release()

    async def get(self, tenant: str, response_id: str) -> dict[str, Any]:
        record = await self.store.get(tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        return record.response

    async def input_items(self, tenant: str, response_id: str) -> dict[str, Any]:
        record = await self.store.get(tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        data = [{"id": new_id("item"), **item} for item in record.context]
        return {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    async def delete(self, tenant: str, response_id: str) -> dict[str, Any]:
        task = self.running.get((tenant, response_id))
        if task is not None:  # stopped first, so that it cannot store itself again
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if not await self.store.delete(tenant, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any]:
        record = await self.store.get(tenant, response_id)
        if record is None:
            raise _not_found(response_id)
        if not record.response.get("background"):
            raise OpenAIError(400, "only background responses can be cancelled", "response_id")
        if record.response["status"] in TERMINAL:
            return record.response
        task = self.running.get((tenant, response_id))
        if task is None:
            raise OpenAIError(
                409, "this response runs on another replica; cancel it there", "response_id"
            )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await self.get(tenant, response_id)


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the next turn's input item."""
    if item["type"] == "message":
        text = "".join(part.get("text", "") for part in item["content"])
        return {"type": "message", "role": "assistant", "content": [_output_text_part(text)]}
    if item["type"] == "function_call":
        return {k: item[k] for k in ("type", "call_id", "name", "arguments")}
    return {"type": "reasoning", "content": item["content"], "summary": []}


def _output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", "response_id")


# ---- routes -------------------------------------------------------------------------------

_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


def add_routes(
    app: FastAPI,
    responses: Responses,
    serving: Callable[[], ServingContext],
    check_model: Callable[[ServingContext, str | None], LoRARequest | None],
) -> None:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}; its input items; /cancel."""

    def tenant(request: Request) -> str:
        return request.state.tenant or ""

    def known_id(response_id: str) -> str:
        """Ids this server never made are not found, without a look in the store."""
        if not _RESPONSE_ID.fullmatch(response_id):
            raise _not_found(response_id)
        return response_id

    @app.post("/v1/responses", **route_docs(ResponsesRequest, ResponseObject, True))
    async def create(request: Request) -> Any:
        ctx = serving()
        body = parse_body(await request.body(), ResponsesRequest)
        lora = check_model(ctx, body.model)
        ctx.require_task("generate")
        if body.background:
            # The work outlives this exchange: its queue room is released by the work.
            ticket = ctx.admission.admit(1)
            caller = Caller(request.state.request_id, ticket, tenant(request), lora)
        else:
            caller = admit(request, ctx, 1, lora)
        work = responses.create(ctx, body, caller)
        result = await cancel_on_disconnect(request.receive, work)
        if isinstance(result, dict):
            return JSONResponse(result)
        return EventSourceResponse(sse_response_events(result), ping=15)

    @app.get("/v1/responses/{response_id}", **route_docs(None, ResponseObject))
    async def retrieve(request: Request, response_id: str) -> Any:
        for name in ("stream", "starting_after", "include"):
            if name in request.query_params:
                raise OpenAIError(400, f"`{name}` is not supported by this server", name)
        return await responses.get(tenant(request), known_id(response_id))

    @app.delete("/v1/responses/{response_id}", **route_docs(None, ResponseDeleted))
    async def delete(request: Request, response_id: str) -> Any:
        return await responses.delete(tenant(request), known_id(response_id))

    @app.post("/v1/responses/{response_id}/cancel", **route_docs(None, ResponseObject))
    async def cancel(request: Request, response_id: str) -> Any:
        return await responses.cancel(tenant(request), known_id(response_id))

    @app.get("/v1/responses/{response_id}/input_items", **route_docs(None, ResponseItemList))
    async def input_items(request: Request, response_id: str) -> Any:
        for name in ("after", "before", "include", "limit", "order"):
            if name in request.query_params:
                raise OpenAIError(400, f"`{name}` is not supported by this server", name)
        return await responses.input_items(tenant(request), known_id(response_id))
