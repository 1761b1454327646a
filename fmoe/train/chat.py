"""Chat templates: conversations -> text, and which characters of it are the assistant's.

A Hugging Face model folder keeps its chat template (a Jinja template) in
`chat_template.jinja` or in `tokenizer_config.json`'s "chat_template" field. `load_chat_template`
finds it beside a tokenizer.json (or takes a file), and `ChatTemplate.render` renders a
conversation as transformers' `apply_chat_template(..., tokenize=False)` does: the same Jinja
settings (sandboxed, trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps
non-ASCII, `raise_exception`, `strftime_now`, `{% generation %}` blocks rendered as plain
text) and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables,
`tools` (function definitions, or None) and `documents` (None); a message's reasoning given
under one of REASONING_FIELDS is given under "reasoning_content" (what most templates read)
and "thinking" (gpt-oss's) too, as transformers does; not under "reasoning".

`ChatTemplate.documents(messages)` says what to train on (fmoe.train.prepare's
--messages_key): the assistant's turn i is the text that rendering messages[:i + 1] adds to
rendering messages[:i] with the generation prompt (the turn's content and its end-of-turn
tokens, not the `<|im_start|>assistant` header the generation prompt already holds). An
assistant message that opens the conversation (i = 0: nothing before it to answer) is
trained the same way where the template renders an empty conversation's generation prompt
as the start of its text (ChatML's); where it cannot (a template that reads messages[0], or
puts the BOS before a first message only: Llama 3's), it is not trained, and stays in the
prompt of the turns after it. When
every such text sits at the same place in the whole conversation's rendering, the
conversation is one document with one character span per assistant turn. Some templates render an earlier turn differently
once later turns follow (Qwen3's drops the reasoning of turns before the last user message):
such a conversation becomes one document per assistant turn, messages[:i + 1] rendered as the
model sees it when it writes turn i, with that turn's span only.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Optional, Union

from fmoe.ops.checks import MissingExtra, check_path

CHAT_TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"  # <name>.jinja beside chat_template.jinja (transformers 5's layout)
TOOL_USE = "tool_use"  # the named template a record with tools is rendered by, where the folder has one
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # older folders keep their special tokens here too
TRAINED_ROLE = "assistant"  # the role whose turns are trained
TOOLS_FIELD = "tools"  # a record's function definitions: the template's `tools`
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, by the names templates read

Span = tuple[int, int]  # [start, end) in characters of a rendered text


def _templates_from_config(path: Path) -> dict[str, str]:
    """The chat templates of a tokenizer_config.json by name: its "chat_template" string as
    "default", or its list of named templates; {} when it has none."""
    template = _read_json(path).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if named and all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            return named
    elif isinstance(template, str):
        return {"default": template}
    elif template is None:
        return {}
    raise ValueError(f"chat_template: {str(path)!r} has a chat_template that is not a string or a list of named ones "
                     "({\"name\": ..., \"template\": ...})")


def _folder_templates(folder: Path) -> dict[str, str]:
    """chat_template.jinja as "default" and additional_chat_templates/<name>.jinja by name."""
    templates = {"default": _read_text(folder / CHAT_TEMPLATE_FILE)} if (folder / CHAT_TEMPLATE_FILE).is_file() else {}
    if (folder / NAMED_TEMPLATES_DIR).is_dir():
        templates.update({p.stem: _read_text(p) for p in sorted((folder / NAMED_TEMPLATES_DIR).glob("*.jinja"))})
    return templates


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"chat_template: {str(path)!r} is not UTF-8 text ({err.reason})") from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"chat_template: cannot read {str(path)!r} as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"chat_template: {str(path)!r} is not a JSON object")
    return data


def _special_tokens(*configs: Path) -> dict[str, str]:
    """The special tokens JSON files name (bos_token, eos_token, ...: strings, or {"content": ...}
    objects), the first file's where several name one; the variables transformers gives a
    chat template."""
    tokens = {}
    for config in reversed(configs):
        if config.is_file():
            tokens.update(_tokens_of(config))
    return tokens


def _tokens_of(config: Path) -> dict[str, str]:
    tokens = {}
    for key, value in _read_json(config).items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    return tokens


SANDBOX_JINJA2 = (3, 1, 6)  # the first jinja2 with the sandbox fixes a template from a model folder (code) needs


def check_jinja2(version: str) -> None:
    """An ImportError unless jinja2 `version` is SANDBOX_JINJA2 or newer: a chat template
    comes from a model folder, and an older sandbox lets such a template escape it."""
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:3])
    if numbers < SANDBOX_JINJA2:
        raise MissingExtra(f"jinja2 {version}: chat templates run in jinja2's sandbox, whose fixes need jinja2 3.1.6 or newer: "
                          "pip install 'fmoe[data]' (or 'jinja2>=3.1.6')")


def _environment():
    import jinja2  # a dependency of torch
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    check_jinja2(jinja2.__version__)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's text for
        transformers' assistant masks) renders its body; the spans come from the prefix rule."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template and the variables it may name.

    Args:
        source: the template's Jinja text.
        variables: its variables besides messages, tools, documents and
            add_generation_prompt: the special tokens (e.g. {"bos_token": "<s>"}) and any
            switches the template reads (e.g. {"enable_thinking": False}).
        origin: where the template came from (for messages and the token file's index).
        tool_use: the folder's "tool_use" template, if it has one: a conversation given tools
            is rendered by it (as transformers' apply_chat_template picks it).
    """

    def __init__(self, source: str, variables: Optional[dict] = None, origin: str = "<string>", tool_use: Optional[str] = None):
        self._template = _compiled(source, origin)
        self._tool_use = None if tool_use is None else _compiled(tool_use, f"{origin} ({TOOL_USE})")
        self.variables = check_template_variables(variables or {})
        self.origin = origin

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "a conversation",
               tools: Optional[list] = None) -> str:
        """The conversation's text, as transformers' apply_chat_template(messages, tools=tools,
        tokenize=False, add_generation_prompt=...). messages: a list of {"role": ..., ...}
        objects, [] where the template can render none (a prompt before the first turn)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ValueError(f"messages: expected a list of messages, objects with a string 'role' ({{\"role\": \"user\", \"content\": "
                             f"\"...\"}}), got {_shown(messages)}")
        # transformers drops the keys whose value is None first (content=None beside tool calls,
        # every schema field of a Parquet row): templates test `'key' in message`, or write "None"
        messages = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
        template, origin = (self._tool_use, f"{self.origin} ({TOOL_USE})") if tools is not None and self._tool_use else (self._template, self.origin)
        try:
            return template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                                   **self.variables)
        except Exception as err:  # a TemplateError, or a TypeError / KeyError / ... from inside the template: name the record
            raise ValueError(f"chat_template: {origin} refused {where} ({type(err).__name__}: {err})") from None

    def documents(self, messages: list[dict], where: str = "a conversation", tools=None) -> list[tuple[str, list[Span]]]:
        """(text, spans) of each document of one conversation (module docstring): `spans` are
        the [start, end) characters of its trained assistant turns, in order. No assistant
        turn: no documents. tools: the conversation's function definitions (a list, or a JSON
        string of one), or None."""
        check_messages(messages, where)
        tools = _tools(tools, where)
        if not any(message["role"] == TRAINED_ROLE for message in messages):  # skipped unrendered: a template may refuse it (Mistral's
            return []  # role alternation refuses a system message alone), which stopped a whole prepare
        render = functools.partial(self.render, tools=tools)
        whole = render(messages, where=where)
        # (messages[:i + 1]'s text, turn i's span in it); the text is kept only once a turn's is
        # not the start of the whole conversation's (then each turn is a document of its own,
        # and earlier texts are rendered again): the n prefixes held O(n^2) characters
        turns, prefixes = [], True
        for i, message in enumerate(messages):
            if message["role"] != TRAINED_ROLE:
                continue
            try:
                head = render(messages[:i], add_generation_prompt=True, where=f"{where} up to message {i}")
            except ValueError:
                if i == 0:  # an opening turn the template cannot prompt for (module docstring): not trained
                    continue
                raise
            text = render(messages[:i + 1], where=f"{where} up to message {i + 1}")
            if i == 0 and not text.startswith(head):  # a BOS before the first message only
                continue
            if not text.startswith(head):
                raise ValueError(f"src: {where}: the chat template ({self.origin}) renders message {i} ({TRAINED_ROLE}) "
                                 "somewhere other than after its generation prompt, so its text cannot be told from the "
                                 "prompt's; choose another --chat_template")
            if prefixes and not whole.startswith(text):
                prefixes = False
                turns = [(render(messages[:j + 1], where=f"{where} up to message {j + 1}"), span) for j, (_, span) in turns]
            turns.append((i, (len(head), len(text))) if prefixes else (text, (len(head), len(text))))
        spans = [span for _, span in turns]
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:  # the prompt of a later turn is shorter than an earlier turn's text
                raise ValueError(f"src: {where}: the chat template ({self.origin}) renders the prompt of a later "
                                 f"{TRAINED_ROLE} turn without the text of an earlier one, so the turns' texts cannot be "
                                 "told apart; choose another --chat_template")
        if prefixes:
            return [(whole, spans)] if turns else []
        return [(text, [span]) for text, span in turns]


def _compiled(source: str, origin: str):
    import jinja2

    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"chat_template: expected a non-empty Jinja template, got {source!r} from {origin}")
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as err:
        raise ValueError(f"chat_template: {origin} is not a valid Jinja template ({err})") from None


def check_messages(messages, where: str) -> None:
    """A conversation: a non-empty list of objects, each with a string "role"."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"src: {where}: expected a conversation, a non-empty list of messages, got {_shown(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"src: {where}: message {i} is not an object with a string 'role' (got {_shown(message)}); "
                             "messages look like {\"role\": \"user\", \"content\": \"...\"}")


def _with_reasoning_aliases(message: dict) -> dict:
    """The message with its reasoning (the first of REASONING_FIELDS it holds, not None) under
    "thinking" (where it has none) and "reasoning_content" too, as transformers gives it."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tools(tools, where: str) -> Optional[list]:
    """A record's tools: None, a list, or a JSON string of a list (as datasets store them)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ValueError(f"src: {where}: its {TOOLS_FIELD!r} string is not JSON ({err.msg})") from None
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"src: {where}: {TOOLS_FIELD!r} must be a list of function definitions (or a JSON string of one), "
                         f"got {_shown(tools)}")
    return tools


def json_object(text: str) -> dict:
    """A --chat_template_kwargs value: a JSON object (argparse type; ValueError otherwise)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{{\"enable_thinking\": false}}' ({err.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {_shown(value)}")
    return value


_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


def check_template_variables(variables) -> dict:
    """A template's extra variables: a dict of names (not the ones render sets) to JSON values."""
    if not isinstance(variables, dict) or not all(isinstance(k, str) and k for k in variables):
        raise ValueError(f"chat_template_kwargs: expected a JSON object of variable names to values, got {_shown(variables)}")
    for name in _RESERVED:
        if name in variables:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the renderer itself; give the template's own switches "
                             "(e.g. {\"enable_thinking\": false})")
    return dict(variables)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_chat_template(tokenizer: Union[str, Path], chat_template: Union[str, Path, None] = None,
                       variables: Optional[dict] = None) -> ChatTemplate:
    """The chat template for a tokenizer.json: `chat_template` (a .jinja file, or a JSON file
    with a "chat_template" field such as a tokenizer_config.json) if given, else the model
    folder's chat_template.jinja (with additional_chat_templates/*.jinja), else its
    tokenizer_config.json's. Of named templates, "default" renders and "tool_use", where there
    is one, renders the conversations given tools, as transformers picks them; the special tokens come
    from the tokenizer_config.json beside the tokenizer, else its special_tokens_map.json (and
    from `chat_template` when it is a JSON file). variables: more of the template's
    variables (e.g. {"enable_thinking": False}), over the special tokens where both name one,
    as apply_chat_template's **kwargs."""
    check_path("tokenizer", tokenizer, "the path of a tokenizer.json")
    folder = Path(tokenizer).parent
    tokens = _special_tokens(folder / TOKENIZER_CONFIG, folder / SPECIAL_TOKENS_MAP)
    extra = check_template_variables(variables or {})
    templates = {}
    if chat_template is not None:
        check_path("chat_template", chat_template, "the path of a template file")
        path = Path(chat_template)
        if path.is_dir():
            raise ValueError(f"chat_template: {str(path)!r} is a directory; expected a template file (.jinja) or a JSON file with a "
                             "\"chat_template\" field")
        if not path.is_file():
            raise FileNotFoundError(f"chat_template: {str(path)!r} does not exist")
        if path.suffix.lower() == ".json":
            templates = _templates_from_config(path)
            if not templates:
                raise ValueError(f"chat_template: {str(path)!r} has no \"chat_template\" field")
            tokens.update(_special_tokens(path))
        else:
            templates = {"default": _read_text(path)}
    elif templates := _folder_templates(folder):
        path = folder / CHAT_TEMPLATE_FILE if "default" in templates else folder / NAMED_TEMPLATES_DIR
    elif (folder / TOKENIZER_CONFIG).is_file():
        path = folder / TOKENIZER_CONFIG
        templates = _templates_from_config(path)
    if templates and "default" not in templates:
        raise ValueError(f"chat_template: {str(path)!r} holds named chat templates ({', '.join(sorted(templates))}) and no 'default'; "
                         "name the one to use with --chat_template=FILE")
    if templates:
        return ChatTemplate(templates["default"], {**tokens, **extra}, origin=str(path), tool_use=templates.get(TOOL_USE))
    raise ValueError(f"chat_template: no {CHAT_TEMPLATE_FILE} and no tokenizer_config.json with a chat_template beside "
                     f"{str(tokenizer)!r}; name one with --chat_template=FILE (.jinja, or a JSON file with a chat_template)")
