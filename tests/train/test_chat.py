"""fmoe.train.chat and `prepare --messages_key`: conversations rendered by a model's chat
template, only the assistant's turns in the loss; checked against transformers."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="fmoe.train.prepare needs the tokenizers package (the fmoe[data] extra)")

from fmoe.train.chat import ChatTemplate, check_jinja2, load_chat_template  # noqa: E402
from fmoe.train.data import index_path, load_corpus  # noqa: E402
from fmoe.train.prepare import prepare  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with transformers' {% generation %} marks around what the assistant writes
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
          "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# as Qwen3's: an assistant turn after the last user message shows its reasoning, an earlier one does not
REASONING = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
             "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
             "{% if m.role == 'assistant' and loop.index0 > ns.last %}"
             "{% generation %}{{ '<think>' + m.reasoning + '</think>' + m.content + '<|im_end|>\\n' }}{% endgeneration %}"
             "{% elif m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>\\n' }}{% endgeneration %}"
             "{% else %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld → 🙂?"},
     {"role": "assistant", "content": "def f(x):\n    return x"}, {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok 🙂"}],
    [{"role": "user", "content": "no answer here"}],  # no assistant turn: skipped
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": ""}],  # an empty reply still ends its turn
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],  # ends with a user turn
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with ChatML's special tokens, and a tokenizer_config.json
    holding the ChatML template, as a Hugging Face model folder keeps them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([(stdlib / name).read_text(encoding="utf-8")[:4000] for name in ("string.py", "textwrap.py")],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("model")
    tok.save(str(folder / "tokenizer.json"))
    _write_config(folder, CHATML)
    return folder


def _tokenizer_only(model_dir, tmp_path):
    """A fresh model folder holding model_dir's tokenizer.json alone."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    return folder


def _write_config(folder, template, **extra):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
              "pad_token": "<|endoftext|>", "chat_template": template, **extra}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _jsonl(path, chats, key="messages"):
    path.write_text("".join(json.dumps({key: chat, "id": i}) + "\n" for i, chat in enumerate(chats)))
    return path


# tools in a system turn, a reasoning block, and the BOS (named only by special_tokens_map.json)
TOOLS = ("{{ bos_token }}{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
         "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}{% generation %}"
         "{% if m.reasoning_content %}{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}{{ m.content + '<|im_end|>\\n' }}"
         "{% endgeneration %}{% else %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _transformers_documents(folder, chats, per_turn=False, tools=None, **variables):
    """transformers' ids and assistant masks of each document, the separator appended (counted
    when it follows an assistant's token): whole conversations, or one per assistant turn;
    tools: each conversation's."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    sep = hf.convert_tokens_to_ids("<|endoftext|>")
    ids, mask = [], []
    for chat, chat_tools in zip(chats, tools or [None] * len(chats)):
        if per_turn:
            parts = [(chat[:i + 1], i) for i, m in enumerate(chat) if m["role"] == "assistant"]
        else:
            parts = [(chat, None)] if any(m["role"] == "assistant" for m in chat) else []
        for messages, turn in parts:
            out = hf.apply_chat_template(messages, tools=chat_tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                         **variables)
            m = list(out["assistant_masks"])
            if turn is not None:  # only the last turn trains: the earlier ones' marks are cleared
                head = hf.apply_chat_template(messages[:turn], tokenize=True, add_generation_prompt=True, return_dict=True,
                                              **variables)["input_ids"]
                m = [0] * len(head) + m[len(head):]
            ids += list(out["input_ids"]) + [sep]
            mask += m + m[-1:]
    return ids, mask


def test_conversations_count_the_assistant_turns_only(model_dir, tmp_path):
    """JSON Lines and Parquet conversations: the ids are transformers' apply_chat_template
    ids and the loss mask its assistant mask (the turn's text and end-of-turn tokens, not its
    header), the separator counted after an assistant's turn; the conversation without an
    assistant message is skipped; the file reads back with its mask."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    want_ids, want_mask = _transformers_documents(model_dir, CHATS)
    assert 0 < sum(want_mask) < len(want_mask) / 2
    pq.write_table(pa.table({"id": list(range(len(CHATS))), "messages": CHATS}), tmp_path / "chat.parquet", row_group_size=2)
    for src in (_jsonl(tmp_path / "chat.jsonl", CHATS), tmp_path / "chat.parquet"):
        out = tmp_path / f"{src.name}.u16"
        index = prepare(src, out, tokenizer=model_dir / "tokenizer.json", messages_key="messages", progress=False)
        assert np.fromfile(out, dtype=np.uint16).tolist() == want_ids, src
        assert np.fromfile(tmp_path / index["loss_mask"], dtype=np.uint8).tolist() == want_mask, src
        assert {k: index[k] for k in ("documents", "conversations", "split_conversations", "messages_key", "chat_template")} == dict(
            documents=3, conversations=3, split_conversations=0, messages_key="messages", chat_template=str(model_dir / "tokenizer_config.json"))
        assert index["prompt_tokens"] == len(want_mask) - sum(want_mask) and "text_key" not in index and "prompt_key" not in index
        assert np.asarray(load_corpus(out).label_mask).tolist() == want_mask
    run = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(tmp_path / "chat.jsonl"), str(tmp_path / "cli.u16"),
                          f"--tokenizer={model_dir / 'tokenizer.json'}", "--messages_key=messages"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(f"; 3 conversations (0 made one document per assistant turn), "
                                       f"{len(want_mask) - sum(want_mask)} tokens outside the assistant's turns left out of the loss (cli.u16.loss_mask)")


def test_the_template_is_found_beside_the_tokenizer_or_named(model_dir, tmp_path):
    """--chat_template (a .jinja file, or a JSON file's chat_template with its special tokens)
    over the folder's chat_template.jinja over its tokenizer_config.json; named templates take
    "default"; the special tokens are the template's variables."""
    folder = _tokenizer_only(model_dir, tmp_path)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    _write_config(folder, [{"name": "tool_use", "template": "T{{ messages[0].content }}"}, {"name": "default", "template": "D{{ eos_token }}"}])
    assert load_chat_template(folder / "tokenizer.json").render(chat) == "D<|im_end|>"
    (folder / "chat_template.jinja").write_text("J{{ pad_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(folder / "tokenizer.json").render(chat) == "J<|endoftext|>qa"
    (tmp_path / "other.jinja").write_text("O{{ messages | length }}{{ add_generation_prompt }}")
    assert load_chat_template(folder / "tokenizer.json", tmp_path / "other.jinja").render(chat, add_generation_prompt=True) == "O2True"
    (tmp_path / "other.json").write_text(json.dumps({"chat_template": "{{ bos_token }}{{ eos_token }}", "bos_token": "<s>"}))
    template = load_chat_template(folder / "tokenizer.json", tmp_path / "other.json")
    assert template.render(chat) == "<s><|im_end|>" and template.origin == str(tmp_path / "other.json")
    # transformers' globals and filters: tojson keeps non-ASCII, raise_exception, loop controls
    template = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}")
    assert template.render([{"role": "user", "content": "é"}, {"role": "x"}]) == '{"role": "user", "content": "é"}'


def test_the_index_names_the_template_by_an_absolute_path(model_dir, tmp_path, monkeypatch):
    """--chat_template given relative to where prepare ran: the index names the file by its
    absolute path, so it still says which template made the ids wherever it is read."""
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    monkeypatch.chdir(tmp_path)
    src = _jsonl(tmp_path / "c.jsonl", [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]])
    index = prepare(src, tmp_path / "o.u16", tokenizer=model_dir / "tokenizer.json", messages_key="messages",
                    chat_template="t.jinja", progress=False)
    assert index["chat_template"] == str((tmp_path / "t.jinja").resolve())
    assert json.loads(index_path(tmp_path / "o.u16").read_text())["chat_template"] == index["chat_template"]


def test_a_template_that_rewrites_earlier_turns_gives_one_document_per_turn(model_dir, tmp_path):
    """Qwen3-style: a turn's reasoning shows only after the last user message, so the whole
    conversation shows the first reply without the reasoning the model wrote it with. Each
    assistant turn is then its own document, as transformers renders messages[:i + 1], with
    that turn alone counted; a conversation with one turn stays whole."""
    folder = _tokenizer_only(model_dir, tmp_path)
    _write_config(folder, REASONING)
    chats = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "add"},
              {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "reasoning": "add again"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning": "greet"}]]
    index = prepare(_jsonl(tmp_path / "c.jsonl", chats), tmp_path / "c.u16", tokenizer=folder / "tokenizer.json", messages_key="messages",
                    progress=False)
    want_ids, want_mask = _transformers_documents(folder, chats, per_turn=True)
    assert np.fromfile(tmp_path / "c.u16", dtype=np.uint16).tolist() == want_ids
    assert np.fromfile(tmp_path / "c.u16.loss_mask", dtype=np.uint8).tolist() == want_mask
    assert (index["documents"], index["conversations"], index["split_conversations"]) == (3, 2, 1)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    counted = tok.decode([t for t, m in zip(want_ids, want_mask) if m], skip_special_tokens=False)
    assert counted == ("<think>add</think>4<|im_end|>\n<|endoftext|><think>add again</think>6<|im_end|>\n<|endoftext|>"
                       "<think>greet</think>hello<|im_end|>\n<|endoftext|>")


def test_tools_reasoning_and_special_tokens_reach_the_template_as_in_transformers(model_dir, tmp_path):
    """A record's "tools" (a list, or a JSON string of one as Parquet keeps them; absent: None)
    is the template's `tools`; reasoning under "reasoning" or "thinking" reaches a template
    that reads "reasoning_content"; a bos_token named only in special_tokens_map.json is a
    variable: the ids and masks of transformers' apply_chat_template(messages, tools=...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _tokenizer_only(model_dir, tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TOOLS}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b → c", "parameters": {"type": "object"}}}]
    chats = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "add them"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "thinking": "greet"}],
             [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]]
    per_chat = [tools, tools, None]
    want_ids, want_mask = _transformers_documents(folder, chats, tools=per_chat)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = tok.decode(want_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|><|im_start|>system") and text.count('"name": "add"') == 2  # the checks bite
    assert "<think>add them</think>" in text and "<think>greet</think>" in text
    records = [{"messages": chats[0], "tools": tools}, {"messages": chats[1], "tools": json.dumps(tools)}, {"messages": chats[2]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.table({"messages": [json.loads(json.dumps(c)) for c in chats],
                             "tools": [json.dumps(tools), json.dumps(tools), None]}), tmp_path / "c.parquet")
    for src in (tmp_path / "c.jsonl", tmp_path / "c.parquet"):
        prepare(src, tmp_path / "o.u16", tokenizer=folder / "tokenizer.json", messages_key="messages", progress=False)
        assert np.fromfile(tmp_path / "o.u16", dtype=np.uint16).tolist() == want_ids, src
        assert np.fromfile(tmp_path / "o.u16.loss_mask", dtype=np.uint8).tolist() == want_mask, src
    for bad, match in (("{not json", r"line 1: its 'tools' string is not JSON"), ({"name": "add"}, r"line 1: 'tools' must be a list")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": chats[0], "tools": bad}) + "\n")
        with pytest.raises(ValueError, match=match):
            prepare(tmp_path / "bad.jsonl", tmp_path / "o.u16", tokenizer=folder / "tokenizer.json", messages_key="messages", progress=False)


@pytest.mark.parametrize("given", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_under_any_of_its_names_reaches_templates_that_read_thinking_or_reasoning_content(given):
    """Reasoning given under any of REASONING_FIELDS renders in a template reading
    message.thinking (gpt-oss's) and in one reading message.reasoning_content; "reasoning" is
    not an alias (a template reading it sees only reasoning given under that name)."""
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", given: "add them"}]
    for field in ("thinking", "reasoning_content", "reasoning"):
        template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{% if m." + field + " %}[think:{{ m." + field + " }}]{% endif %}"
                                "{{ m.content }}{% endfor %}")
        shown = field != "reasoning" or given == "reasoning"
        assert template.render(chat) == f"<user>2+2?<assistant>{'[think:add them]' if shown else ''}4", (given, field)


def test_a_message_s_own_thinking_is_kept_beside_its_reasoning_content():
    """Reasoning goes under "thinking" only where the message has none, as transformers'
    {"thinking": reasoning, **message, "reasoning_content": reasoning}."""
    template = ChatTemplate("{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}]{{ m.content }}{% endfor %}")
    message = {"role": "assistant", "content": "4", "reasoning_content": "2+2", "thinking": "own thinking"}
    assert template.render([message]) == "[own thinking|2+2]4"


# a default template that reads a message's optional field (as Llama 3.1's reads 'tool_calls')
OPTIONAL_FIELD = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}{% generation %}"
                  "{% if 'tool_calls' in m %}{{ m.tool_calls | length }}{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endgeneration %}"
                  "{% else %}{% if 'tool_calls' in m %}{{ m.tool_calls | length }}{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_the_special_tokens_of_tokenizer_config_json_come_before_the_older_map(model_dir, tmp_path):
    """A folder with both files (the map often stale): each token as tokenizer_config.json
    names it, the map's only where the config has none."""
    folder = _tokenizer_only(model_dir, tmp_path)
    _write_config(folder, "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}", bos_token="<|begin_of_text|>")
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>",
                                                                "unk_token": "<unk>"}))
    assert load_chat_template(folder / "tokenizer.json").render([{"role": "user", "content": "q"}]) == "<|begin_of_text|>|<|im_end|>|<|endoftext|>|<unk>"


@pytest.mark.parametrize("layout", ["tokenizer_config", "files"])
def test_named_templates_tool_use_and_fields_of_none_as_in_transformers(model_dir, tmp_path, layout):
    """A folder of named templates (a list in tokenizer_config.json, or transformers 5's chat_template.jinja and
    additional_chat_templates/tool_use.jinja): a record with tools renders by "tool_use", one without by "default"; a
    message's fields of None are dropped before rendering (a Parquet row holds every field, `tool_calls: null` beside a
    plain turn): the ids and masks of transformers' apply_chat_template(messages, tools=...)."""
    folder = _tokenizer_only(model_dir, tmp_path)
    if layout == "tokenizer_config":
        _write_config(folder, [{"name": "default", "template": OPTIONAL_FIELD}, {"name": "tool_use", "template": TOOLS}],
                      bos_token="<|im_start|>")
    else:
        _write_config(folder, None, bos_token="<|im_start|>")
        (folder / "chat_template.jinja").write_text(OPTIONAL_FIELD)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOLS)
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}}}]
    chats = [[{"role": "user", "content": "2+2?", "tool_calls": None}, {"role": "assistant", "content": "4", "tool_calls": None}],
             [{"role": "user", "content": "hi", "tool_calls": None}, {"role": "assistant", "content": "yo", "tool_calls": [{"id": 1}]}]]
    want_ids, want_mask = _transformers_documents(folder, chats, tools=[tools, None])
    text = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).decode(want_ids, skip_special_tokens=False)
    assert text.count('"name": "add"') == 1 and "<|im_start|>assistant\n1yo" in text  # the checks bite: both templates ran
    records = [{"messages": chats[0], "tools": tools}, {"messages": chats[1]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare(tmp_path / "c.jsonl", tmp_path / "o.u16", tokenizer=folder / "tokenizer.json", messages_key="messages", progress=False)
    assert np.fromfile(tmp_path / "o.u16", dtype=np.uint16).tolist() == want_ids
    assert np.fromfile(tmp_path / "o.u16.loss_mask", dtype=np.uint8).tolist() == want_mask
    # named templates without a "default": which to use is the user's to say
    _write_config(folder, [{"name": "tool_use", "template": TOOLS}, {"name": "rag", "template": CHATML}])
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if layout == "files":
        (folder / "additional_chat_templates" / "tool_use.jinja").unlink()
    with pytest.raises(ValueError, match=r"holds named chat templates \(rag, tool_use\) and no 'default'; name the one to use with --chat_template"):
        load_chat_template(folder / "tokenizer.json")


def test_template_switches_are_variables_as_in_transformers(model_dir, tmp_path):
    """chat_template_kwargs (--chat_template_kwargs, a JSON object) are the template's
    variables, over a special token of the same name: Qwen3's enable_thinking=False puts an
    empty reasoning block in the generation prompt, out of the loss; the ids and masks are
    transformers' apply_chat_template(..., enable_thinking=False)."""
    folder = _tokenizer_only(model_dir, tmp_path)
    switch = CHATML.replace("{{ '<|im_start|>assistant\\n' }}",
                            "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    switch = switch.replace("{% generation %}", "{% if loop.last and enable_thinking is defined and not enable_thinking %}<think></think>"
                            "{% endif %}{% generation %}")
    assert switch.count("enable_thinking") == 4
    _write_config(folder, "{{ eos_token }}" + switch)
    chats = [CHATS[0][1:3], CHATS[2]]
    src = _jsonl(tmp_path / "c.jsonl", chats)
    prepare(src, tmp_path / "o.u16", tokenizer=folder / "tokenizer.json", messages_key="messages", progress=False,
            chat_template_kwargs={"enable_thinking": False, "eos_token": "<|im_start|>"})
    want_ids, want_mask = _transformers_documents(folder, chats, enable_thinking=False, eos_token="<|im_start|>")
    assert np.fromfile(tmp_path / "o.u16", dtype=np.uint16).tolist() == want_ids
    assert np.fromfile(tmp_path / "o.u16.loss_mask", dtype=np.uint8).tolist() == want_mask
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.decode(want_ids, skip_special_tokens=False).count("<think></think>") == 2
    assert "<think>" not in tok.decode([t for t, m in zip(want_ids, want_mask) if m], skip_special_tokens=False)
    assert tok.decode(want_ids[:2], skip_special_tokens=False) == "<|im_start|><|im_start|>"  # eos_token as given
    plain, _ = _transformers_documents(folder, chats)
    assert plain != want_ids  # the switch changes the text
    template = load_chat_template(folder / "tokenizer.json", variables={"eos_token": "E"})
    assert template.render([{"role": "user", "content": "q"}]).startswith("E<|im_start|>")
    run = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(src), str(tmp_path / "cli.u16"), f"--tokenizer={folder / 'tokenizer.json'}",
                          "--messages_key=messages", "--chat_template_kwargs={enable_thinking: false}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--chat_template_kwargs: expected a JSON object" in run.stderr, run.stderr


@pytest.mark.parametrize("records, kwargs, match", [
    ([{"messages": "hi"}], {}, r"line 1: expected a conversation, a non-empty list of messages, got 'hi'"),
    ([{"messages": []}], {}, r"line 1: expected a conversation"),
    ([{"messages": [{"content": "hi"}]}], {}, r"line 1: message 0 is not an object with a string 'role' \(got \{'content': 'hi'\}\)"),
    ([{"text": "hi"}], {}, r"line 1 has no 'messages' field \(no such key; keys: \['text'\]\); choose it with --messages_key"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], {}, r"no conversation in '.*' has a message whose role is 'assistant'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], dict(prompt_key="prompt"), "prompt_key: a conversation .* holds its own prompts"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], dict(messages_key=""), "messages_key: expected a non-empty field name, got ''"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], dict(messages_key=None, chat_template="t.jinja"),
     "chat_template, chat_template_kwargs: they render conversations, which need --messages_key"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], dict(chat_template_kwargs={"messages": []}),
     "chat_template_kwargs: 'messages' is set by the renderer itself"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], dict(chat_template_kwargs=[1]),
     r"chat_template_kwargs: expected a JSON object of variable names to values, got \[1\]"),
    # (each with an assistant turn: a conversation without one is skipped unrendered)
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}],
     dict(template="{% if messages[1].role == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"),
     r"line 1 \(TemplateError: roles must alternate\)"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}]}], dict(template="{{ messages.__class__.__mro__ }}"),
     r"refused .* \(SecurityError"),
    # an error of Python's inside the template, not jinja's: the record is named too
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}]}], dict(template="{{ messages[0].content + 1 }}"), r"refused '.*c.jsonl' line 1 \(TypeError: can only concatenate str"),
    ([{"messages": [{"role": "user", "content": "a"}]}], dict(template="{% for %}"), "is not a valid Jinja template"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
     dict(template="{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}"),
     r"line 1: the chat template .* renders message 1 \(assistant\) somewhere other than after its generation prompt"),
    ([{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                    {"role": "assistant", "content": "a2"}]}],
     dict(template="{% if add_generation_prompt %}U:{{ messages[0].content }}|A:{% else %}"
                   "{% for m in messages %}{{ m.role[0] | upper }}:{{ m.content }}|{% endfor %}{% endif %}"),
     r"line 1: the chat template .* renders the prompt of a later assistant turn without the text of an earlier one"),
    ([{"messages": [{"role": "user", "content": "a<|endoftext|>"}, {"role": "assistant", "content": "b"}]}], {},
     "line 1 already holds the separator id 0 .'<.endoftext.>', token 6 of the rendered conversation.: a message's text holds it"),
    # Llama 2's and Mistral's templates end each assistant turn with the EOS, the first separator prepare looks for
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
     dict(template="{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}<|endoftext|>{% endif %}{% endfor %}"),
     "line 1 already holds the separator id 0 .*or the chat template writes it .*choose a separator the template never writes with --separator"),
])
def test_bad_conversations_and_templates_stop_with_a_message(model_dir, tmp_path, records, kwargs, match):
    folder = _tokenizer_only(model_dir, tmp_path)
    _write_config(folder, kwargs.pop("template", CHATML))
    kwargs.setdefault("messages_key", "messages")
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=match):
        prepare(src, tmp_path / "o.u16", tokenizer=folder / "tokenizer.json", progress=False, **kwargs)
    assert not (tmp_path / "o.u16").exists() and not list(tmp_path.glob(".*tmp"))


def test_missing_templates_and_text_sources(model_dir, tmp_path):
    folder = _tokenizer_only(model_dir, tmp_path)
    src = _jsonl(tmp_path / "c.jsonl", CHATS[:1])
    kw = dict(tokenizer=folder / "tokenizer.json", messages_key="messages", progress=False)
    with pytest.raises(ValueError, match=r"chat_template: no chat_template.jinja and no tokenizer_config.json with a chat_template beside"):
        prepare(src, tmp_path / "o.u16", **kw)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"name one with --chat_template=FILE"):
        prepare(src, tmp_path / "o.u16", **kw)
    with pytest.raises(FileNotFoundError, match=r"chat_template: '.*nope.jinja' does not exist"):
        prepare(src, tmp_path / "o.u16", chat_template=tmp_path / "nope.jinja", **kw)
    # a directory was said not to exist; a None tokenizer raised pathlib's TypeError
    with pytest.raises(ValueError, match=r"chat_template: '.*' is a directory; expected a template file"):
        prepare(src, tmp_path / "o.u16", chat_template=tmp_path, **kw)
    with pytest.raises(ValueError, match="tokenizer: expected the path of a tokenizer.json"):
        load_chat_template(None)
    with pytest.raises(ValueError, match="chat_template: expected the path of a template file"):
        load_chat_template(folder / "tokenizer.json", 5)
    with pytest.raises(ValueError, match=r"chat_template: '.*tokenizer_config.json' has no \"chat_template\" field"):
        prepare(src, tmp_path / "o.u16", chat_template=folder / "tokenizer_config.json", **kw)
    (tmp_path / "t.txt").write_text("plain")
    with pytest.raises(ValueError, match=r"a text file has no 'messages' \(--messages_key\) field"):
        prepare(tmp_path / "t.txt", tmp_path / "o.u16", **kw)
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValueError, match="chat_template: expected a non-empty Jinja template"):
        prepare(src, tmp_path / "o.u16", chat_template=tmp_path / "empty.jinja", **kw)
    # the CLI prints the message
    run = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(src), str(tmp_path / "o.u16"), f"--tokenizer={folder / 'tokenizer.json'}",
                          "--messages_key=messages", f"--chat_template={tmp_path / 'empty.jinja'}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "error: chat_template: expected a non-empty Jinja template" in run.stderr


# Llama 3's: the BOS before the first message only, so an empty conversation's generation prompt has none
BOS_FIRST = ("{% for m in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
             "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Qwen2.5's: a default system turn unless messages[0] is one (an empty conversation has no messages[0])
READS_FIRST = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe helpful.<|im_end|>\\n' }}{% endif %}"
               "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_an_assistant_turn_that_opens_the_conversation():
    """A conversation that opens with the assistant's greeting stopped the whole prepare run
    under templates that cannot render an empty conversation's generation prompt as the start
    of the first turn (Llama 3's BOS, Qwen2.5's messages[0]): that turn is not trained, the
    later ones are; under ChatML it is trained as any other turn."""
    chat = [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]

    def trained(template, messages):
        return [[text[a:b] for a, b in spans] for text, spans in template.documents(messages)]

    chatml = ChatTemplate(CHATML)
    assert trained(chatml, chat) == [["Hi!<|im_end|>\n", "4<|im_end|>\n"]]
    for source in (BOS_FIRST, READS_FIRST):
        template = ChatTemplate(source, {"bos_token": "<|begin_of_text|>"})
        (text, spans), = template.documents(chat)
        assert text == template.render(chat)
        assert [text[a:b] for a, b in spans] == (["4<|eot_id|>"] if source == BOS_FIRST else ["4<|im_end|>\n"])
        assert template.documents(chat[:1]) == []  # nothing else to train: skipped, as a conversation without an assistant turn
    with pytest.raises(ValueError, match=r"renders message 1 \(assistant\) somewhere other than after its generation prompt"):
        ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}").documents(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # a later turn still refuses such a template


def test_turns_that_overlap_by_one_character_are_refused():
    """A template that continues a final assistant message under add_generation_prompt (its
    end-of-turn "|" left off): the later turn's prompt is one character short of the earlier
    turn's text, so the later span would take "|assistant:" into training."""
    template = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                            "{% if not (loop.last and add_generation_prompt and m.role == 'assistant') %}|{% endif %}{% endfor %}"
                            "{% if add_generation_prompt and messages[-1].role != 'assistant' %}assistant:{% endif %}")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A1"}, {"role": "assistant", "content": "A2"}]
    with pytest.raises(ValueError, match="renders the prompt of a later assistant turn without the text of an earlier one"):
        template.documents(chat)
    (text, spans), = template.documents(chat[:2])  # one assistant turn: nothing to overlap
    assert [text[a:b] for a, b in spans] == ["A1|"]


def test_a_long_conversation_holds_no_copy_of_each_prefix():
    """documents() kept the text of messages[:i + 1] for every assistant turn until the end:
    O(n^2) characters held (4000 messages: 2.9 GB). Only the spans are kept where every turn
    sits in the whole rendering; a template that rewrites earlier turns still gets each
    turn's own text (rendered again)."""
    import tracemalloc

    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: héllo wörld 🙂 " * 3, "reasoning": "r"}
            for i in range(300)]
    template = ChatTemplate(CHATML)
    tracemalloc.start()
    try:
        (text, spans), = template.documents(chat)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(spans) == 150 and text == template.render(chat)
    assert peak < 20 * 4 * len(text), (peak, len(text))  # the prefixes: 150 texts of 16K characters on average, 40 times the whole
    per_turn = ChatTemplate(REASONING).documents(chat[:6] + [{"role": "user", "content": "last"}, {"role": "assistant", "content": "a",
                                                                                                  "reasoning": "why"}])
    assert len(per_turn) == 4 and all(text.endswith(text[a:b]) for text, [(a, b)] in per_turn)
    assert per_turn[-1][0].endswith("<think>why</think>a<|im_end|>\n")


def test_render_names_a_bad_conversation():
    """render is public (README): a None or a list of non-messages raised a TypeError or an
    AttributeError from inside; an empty list renders (the prompt before a first turn)."""
    template = ChatTemplate(CHATML)
    assert template.render([], add_generation_prompt=True) == "<|im_start|>assistant\n"
    for bad in (None, "hi", [1], [{"content": "x"}], ({"role": "user", "content": "x"},)):
        with pytest.raises(ValueError, match="messages: expected a list of messages, objects with a string 'role'"):
            template.render(bad)


def test_a_conversation_without_an_assistant_turn_is_skipped_unrendered():
    """It was rendered first: a template that refuses it (Mistral's role alternation, for a
    system message alone) stopped the whole prepare instead of the record being skipped."""
    template = ChatTemplate("{% if messages[-1]['role'] != 'assistant' and not add_generation_prompt %}"
                            "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                            "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    assert template.documents([{"role": "system", "content": "be brief"}]) == []
    assert template.documents([{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]) == []
    assert template.documents([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == [("[user]q[assistant]a", [(7, 19)])]
    with pytest.raises(ValueError, match="refused a conversation"):  # with an assistant turn it is rendered, and refused, as before
        template.documents([{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "b"},
                            {"role": "user", "content": "q"}])


def test_a_jinja2_without_the_sandbox_fixes_is_refused():
    """A chat template is code from a model folder, run in jinja2's sandbox: jinja2 before
    3.1.6 (torch's unpinned dependency could bring one) lets it escape, so it is refused,
    naming the version and the fix; 3.1.6 and newer pass, whatever their suffix."""
    for old in ("3.1.5", "3.0.3", "2.11.3"):
        with pytest.raises(ImportError, match=rf"jinja2 {old}: chat templates run in jinja2's sandbox, .*'jinja2>=3\.1\.6'"):
            check_jinja2(old)
    for new in ("3.1.6", "3.2.0", "4.0.0rc1", "3.1.10"):
        check_jinja2(new)


def test_a_reply_token_that_begins_in_the_generation_prompt_is_trained(tmp_path):
    """A generation prompt that ends in a space ("### Response: "), and a byte-level BPE that
    merges the space with the reply's first word ("ĠYes", as GPT-2's, Llama 3's and Qwen's
    vocabularies do): the token holds reply characters, so it is trained, as transformers'
    assistant mask trains it (it was left out: a token counted only when its first
    character was in the reply, and every reply lost its first word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Yes indeed. " * 50 + "### Response: Yes " * 50 + "### Instruction: Say yes\n" * 50],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.token_to_id("ĠYes") is not None
    folder = tmp_path / "m"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    _write_config(folder, "{% for m in messages %}{% if m.role == 'user' %}### Instruction: {{ m.content }}\n"
                          "{% else %}### Response: {% generation %}{{ m.content }}\n{% endgeneration %}{% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}### Response: {% endif %}")
    chats = [[{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "Yes indeed"}]]
    want_ids, want_mask = _transformers_documents(folder, chats)
    prepare(_jsonl(tmp_path / "c.jsonl", chats), tmp_path / "c.u16", tokenizer=folder / "tokenizer.json", messages_key="messages",
            progress=False)
    ids = np.fromfile(tmp_path / "c.u16", dtype=np.uint16).tolist()
    mask = np.fromfile(tmp_path / "c.u16.loss_mask", dtype=np.uint8).tolist()
    assert ids == want_ids and mask == want_mask
    assert [tok.id_to_token(i) for i, m in zip(ids, mask) if m][:2] == ["ĠYes", "Ġindeed"]
