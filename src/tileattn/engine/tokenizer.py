"""Tokenizer: text <-> token ids through the `tokenizers` library, chat templates through jinja2.

Two sources: an HF checkpoint directory (tokenizer.json + tokenizer_config.json, the chat template
there or in chat_template.jinja) and GGUF metadata: GPT-2 style byte-level BPE from the
tokenizer.ggml.tokens / merges / token_type arrays, or a SentencePiece vocabulary (Llama 2, Mistral)
as byte-fallback BPE from tokens / scores / token_type.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

# GGUF token_type values (llama.cpp's llama_token_attr): 3 = control (special), 4 = user-defined.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# Pre-tokenizer split patterns named by GGUF's tokenizer.ggml.pre (the regexes llama.cpp uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                "qwen2": _QWEN2_SPLIT}


# The variables apply_chat_template gives every chat template itself; its **kwargs add others.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def read_json_object(file: str) -> dict:
    """A checkpoint's JSON file that must hold an object; ValueError naming the file otherwise."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(value).__name__}")
    return value


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (a str that is not Unicode text, as JSON's
    \\ud800 escapes can make), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`.

    Attributes: bos_token_id, eos_token_id (int | None), vocab_size, chat_template (str | None).
    """

    def __init__(self, backend, *, chat_template=None, bos_token=None, eos_token=None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """str -> token ids; add_special_tokens applies the tokenizer's post-processor (e.g. BOS).
        Through encode_batch, whose Rust side runs without the GIL (encode holds it: a 9 MB prompt
        took 7 s with no other Python thread running), so a server thread tokenizing a long prompt
        leaves the event loop serving the other requests; the ids are encode's. ValueError for a
        str that is not Unicode text (a lone surrogate, which JSON's \\ud800 escapes can carry)."""
        try:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            at = lone_surrogate(text) if isinstance(text, str) else None
            if at is not None:
                raise ValueError(f"the text has a lone surrogate (U+{ord(text[at]):04X} at character {at}), which "
                                 "is not Unicode text") from None
            raise

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch, skip_special_tokens: bool = True) -> list[str]:
        """Several decodes in one call (the Rust side runs them without the GIL between items)."""
        return self.backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) with the model's template.

        Raises ValueError when the checkpoint has no chat template or messages is malformed.
        """
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json / GGUF metadata)")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        # the variables named in TEMPLATE_VARIABLES
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def set_chat_template(self, source: str) -> None:
        """Replace the checkpoint's chat template (jinja2 source, as HF templates are written).
        Raises ValueError when it does not compile."""
        self._template = _compile_template(source)
        self.chat_template = source

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json, chat_template.jinja or chat_template.json) in ``path``.

        Raises FileNotFoundError when tokenizer.json is missing, ValueError when it is unreadable.
        """
        from tokenizers import Tokenizer as Backend

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer in {path}: tokenizer.json is missing "
                                    "(the engine needs a fast tokenizer file)")
        try:
            backend = Backend.from_file(file)
        except Exception as exc:  # the Rust error text says what is wrong with the file
            raise ValueError(f"cannot read {file}: {exc}") from None
        config = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            config = read_json_object(config_file)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        processor_file = os.path.join(path, "chat_template.json")  # multimodal checkpoints' processor template
        if template is None and os.path.isfile(processor_file):
            template = read_json_object(processor_file).get("chat_template")
        return cls(backend, chat_template=template, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """The tokenizer GGUF metadata describes, built the way transformers' GGUF loader builds it.

        tokenizer.ggml.model "gpt2": byte-level BPE from tokens + merges. "llama" (SentencePiece
        vocabularies: Llama 2, Mistral): BPE with byte fallback over "\u2581"-spelled pieces, merges
        from the file or derived from tokenizer.ggml.scores. BOS/EOS from the *_token_id keys,
        add_bos_token (default true for "llama") / add_eos_token through the post-processor.

        Raises ValueError for other tokenizer models or missing arrays.
        """
        from tokenizers import AddedToken, processors

        kind = meta.get("tokenizer.ggml.model")
        builders = {"gpt2": _gguf_byte_level, "llama": _gguf_sentencepiece}
        if kind not in builders:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
        backend = builders[kind](meta, tokens)

        def token(key):
            index = meta.get(key)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        special = {t for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL}
        if kind == "llama":  # transformers also registers unk/bos/eos/pad as special (skipped on decode)
            special |= {token(f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "bos", "eos", "padding")}
            special.discard(None)
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in tokens if t in special])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED])
        # Older SentencePiece GGUFs carry no add_bos_token flag; llama.cpp (and transformers) add BOS.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None
        if add_bos or add_eos:
            head = f"{bos}:0 " if add_bos else ""
            tail = f" {eos}:0" if add_eos else ""
            pair_head = f" {bos}:1" if add_bos else ""
            pair_tail = f" {eos}:1" if add_eos else ""
            backend.post_processor = processors.TemplateProcessing(
                single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail}{pair_head} $B:1{pair_tail}",
                special_tokens=[(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on])
        elif kind == "gpt2":
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        return cls(backend, chat_template=meta.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)


def _gguf_byte_level(meta, tokens):
    """GPT-2 style byte-level BPE: tokens are spelled in the byte alphabet, merges are listed."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.merges missing)")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GGUF_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # SmolLM's tokenizer splits every digit apart before byte-level BPE
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(meta, tokens):
    """SentencePiece vocabulary as BPE: spaces spelled "\u2581", one "\u2581" prepended to the text
    (first piece only, never after a special token), characters outside the vocabulary as <0xNN>
    byte tokens. No normalizer. tokenizer.ggml.add_space_prefix is not read (transformers ignores
    it too and always prepends).
    """
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {token: i for i, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF SentencePiece tokenizer needs tokenizer.ggml.scores (one per token) "
                             "or tokenizer.ggml.merges")
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1)])  # drop the prepended space again
    return backend


def _merges_from_scores(vocab: dict, scores: dict) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two vocabulary
    pieces is a merge, ranked by the whole piece's score (higher first), then longer left part,
    then longer right part; equal keys keep vocabulary order.
    """
    merges = [(piece[:i], piece[i:], score) for piece, score in scores.items() for i in range(1, len(piece))
              if piece[:i] in vocab and piece[i:] in vocab]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties stay in order
    return [(left, right) for left, right, _ in merges]


def _token_text(value):
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile_template(source: str):
    """A sandboxed jinja2 template with the helpers HF chat templates call."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None
