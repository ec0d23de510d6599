"""OpenAI chat messages → the prompt the model's chat template makes of them (plus their images).

Content parts are flattened into the string content chat templates expect: text parts joined by
newlines, each image part replaced by the model's image placeholder token (``<image>`` for
LLaVA), in order, with its image decoded from a ``data:`` URL. Every error names the message and
part at fault (``messages[1].content[0].image_url.url``).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from .errors import bad_request
from .images import decode_data_url
from .tools import ToolPlan, template_supports_tools, tool_calls_of, written_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Accepted message roles (``developer`` is given to the template as ``system``)."""
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "function_call", "refusal",
                          "annotations", "audio", "reasoning_content", "reasoning"})
"""The keys of a message this server reads, and checks the type of: OpenAI's, so that a reply's
``message.model_dump()`` can go back into the history (``annotations`` is accepted and not used; a
``refusal`` stands in for a missing ``content``; an assistant's ``tool_calls`` and a tool message's
``tool_call_id`` and ``name`` go to the template; ``function_call`` and ``audio`` must be null), and
vLLM's ``reasoning_content`` / ``reasoning`` of an assistant message (given to the template, which
may show or drop it). Any other key (litellm's ``provider_specific_fields``, ...) is ignored, as
vLLM ignores it."""
_STRING_KEYS = ("name", "tool_call_id", "refusal", "reasoning_content", "reasoning")
PART_TYPES = ("text", "image_url", "refusal")
"""Accepted content part types (an assistant's ``refusal`` part is its text)."""
_UNSUPPORTED = {"function_call": "function calls", "audio": "audio replies"}


@attrs.frozen
class ChatOptions:
    """How a conversation is rendered (the request's template fields)."""

    chat_template: str | None = None
    """A template instead of the tokenizer's."""
    add_generation_prompt: bool = True
    """End with the assistant's turn header."""
    continue_final_message: bool = False
    """Let the reply continue the last (assistant) message."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra template variables."""
    add_special_tokens: bool = False
    """Let the tokenizer add its special tokens (e.g. BOS) to the rendered text."""

    @classmethod
    def from_request(cls, body: Any, settings: Any) -> ChatOptions:
        """The options of a chat or tokenize request (``chat_template`` only if the server trusts
        requests' templates; else the server's own).

        :raises APIError: 400 for a request template the server does not accept.
        """
        if body.chat_template is not None and not settings.trust_request_chat_template:
            raise bad_request("chat_template in requests is refused by this server (start it with "
                              "--trust-request-chat-template to allow it)", param="chat_template",
                              code="unsupported")
        kwargs = body.chat_template_kwargs
        documents = getattr(body, "documents", None)
        if documents is not None:  # vLLM gives them to the template as `documents`
            kwargs = {"documents": documents, **(kwargs or {})}
        return cls(chat_template=body.chat_template or settings.chat_template,
                   add_generation_prompt=True if body.add_generation_prompt is None else body.add_generation_prompt,
                   continue_final_message=bool(body.continue_final_message),
                   chat_template_kwargs=kwargs, add_special_tokens=bool(body.add_special_tokens))


@attrs.frozen
class ParsedMessages:
    """Messages checked and flattened for the template, and where their images are."""

    conversation: list[dict[str, Any]]
    """``[{"role", "content"}]`` with string contents; an assistant's calls under ``tool_calls`` (a list
    of :class:`~modelrunner.tool_parser.ToolCall`), a tool message's ``tool_call_id`` and ``name``."""
    image_urls: list[tuple[str, str]]
    """``(data URL, request field)`` per image, in prompt order."""


def parse_messages(messages: Any, image_token: str | None, param: str = "messages") -> ParsedMessages:
    """Check ``messages`` and flatten their contents.

    :param image_token: the model's image placeholder (None: image parts are refused).
    :raises APIError: 400 naming the message, part and field at fault.
    """
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"{param} must be a non-empty list of {{'role', 'content'}} objects", param=param)
    conversation: list[dict[str, str]] = []
    image_urls: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}",
                              param=where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
        for key in _STRING_KEYS:
            if message.get(key) is not None and not isinstance(message[key], str):
                raise bad_request(f"{where}.{key} must be a string or null, got {type(message[key]).__name__}",
                                  param=f"{where}.{key}")
        for key in ("tool_calls", "annotations"):
            if message.get(key) is not None and not isinstance(message[key], list):
                raise bad_request(f"{where}.{key} must be a list or null, got {type(message[key]).__name__}",
                                  param=f"{where}.{key}")
        calls = tool_calls_of(message, where) if message.get("tool_calls") else []
        if calls and role != "assistant":
            raise bad_request(f"{where}.tool_calls: only assistant messages carry tool calls",
                              param=f"{where}.tool_calls")
        for key in ("function_call", "audio"):
            if message.get(key) is not None:
                raise bad_request(f"{where}.{key}: {_UNSUPPORTED[key]} are not supported by this server (got "
                                  f"{message[key]!r}); accepted: null", param=f"{where}.{key}", code="unsupported")
        content = message.get("content")
        if content is None and role == "assistant":
            content = message.get("refusal") or ""
        text = _flatten(content, f"{where}.content", image_token, image_urls)
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            entry.update({k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)})
        if role == "assistant":
            entry.update({k: message[k] for k in ("reasoning_content", "reasoning") if isinstance(message.get(k), str)})
        conversation.append(entry)
    return ParsedMessages(conversation, image_urls)


def echo_text(parsed: ParsedMessages, options: ChatOptions) -> str:
    """What vLLM's ``echo`` puts before a reply: the last message's text when it has the reply's role
    (``assistant`` after a generation prompt, else the last message's own role), else nothing."""
    if not parsed.conversation:
        return ""
    last = parsed.conversation[-1]
    role = "assistant" if options.add_generation_prompt else last["role"]
    return last["content"] if last["role"] == role else ""


def _flatten(content: Any, where: str, image_token: str | None, image_urls: list[tuple[str, str]]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts, got "
                          f"{'null' if content is None else type(content).__name__}", param=where)
    pieces = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{at}.text must be a string", param=f"{at}.text")
            pieces.append(part["text"])
        elif kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise bad_request(f"{at}.refusal must be a string", param=f"{at}.refusal")
            pieces.append(part["refusal"])
        elif kind == "image_url":
            if image_token is None:
                raise bad_request(f"{at}: this model takes no images (it has no image placeholder token); send "
                                  "text parts only", param=at, code="unsupported")
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            image_urls.append((url, f"{at}.image_url.url"))
            pieces.append(image_token)
        else:
            got = repr(kind) if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{at}.type must be one of {', '.join(PART_TYPES)}; got {got}", param=f"{at}.type")
    return "\n".join(pieces)


def render(llm: Any, tokenizer: Any, parsed: ParsedMessages, options: ChatOptions,
           param: str = "messages", tools: ToolPlan | None = None) -> dict[str, Any]:
    """The engine prompt for ``parsed``: ``{"prompt", "prompt_token_ids"}`` plus ``"images"`` when
    there are any (decoded here; call it off the event loop).

    :param tools: the request's tools: a template with tool support gets them as ``tools=``; one
        without gets a system message describing them (see :mod:`.tools`).
    :raises APIError: 400 for a bad image or a conversation the template cannot render.
    """
    images = [decode_data_url(url, where) for url, where in parsed.image_urls]
    if options.add_generation_prompt and options.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true (continuing the "
                          "last message adds no new turn)", param="continue_final_message")
    conversation, kwargs = parsed.conversation, options.chat_template_kwargs
    if tools is not None or any("tool_calls" in m for m in conversation):
        conversation, kwargs = _with_tools(llm, conversation, options, tools)
    try:
        prompt = llm.chat_prompt(conversation, chat_template=options.chat_template,
                                 add_generation_prompt=options.add_generation_prompt,
                                 continue_final_message=options.continue_final_message,
                                 chat_template_kwargs=kwargs)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
    if options.add_special_tokens:
        prompt["prompt_token_ids"] = tokenizer.encode(prompt["prompt"], add_special_tokens=True)
    if images:
        prompt["images"] = images
    return prompt


def _with_tools(llm: Any, conversation: list[dict[str, Any]], options: ChatOptions,
                tools: ToolPlan | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The conversation and template variables for a request with tools or earlier calls: tool-aware
    templates get ``tools=`` and each call with its arguments as a dict (as vLLM gives them); others
    get the calls written into the assistant's text and a system message describing the tools."""
    kwargs = dict(options.chat_template_kwargs or {})
    out: list[dict[str, Any]] = []
    if template_supports_tools(llm, options.chat_template):
        if tools is not None:
            kwargs.setdefault("tools", tools.template_tools())
        for message in conversation:
            if "tool_calls" in message:
                message = {**message, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                    for c in message["tool_calls"]]}
            out.append(message)
        return out, kwargs
    write = tools.format_calls if tools is not None else written_calls
    for message in conversation:
        if "tool_calls" in message:
            text = "\n".join(t for t in (message["content"], write(message["tool_calls"])) if t)
            message = {"role": message["role"], "content": text}
        out.append(message)
    if tools is not None and tools.calls_tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools.prompt()}"}
        else:
            out.insert(0, {"role": "system", "content": tools.prompt()})
    return out, kwargs or None
