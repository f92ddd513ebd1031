"""Tokenizers (through the ``tokenizers`` package) and chat templates.

* :func:`load_tokenizer` / :func:`read_chat_template` read an HF folder's ``tokenizer.json`` and its
  template (``tokenizer_config.json`` or ``chat_template.jinja``).
* :func:`byte_level_bpe` builds a GPT-2-style byte-level BPE tokenizer from a vocabulary and merges
  (what a GGUF file with ``tokenizer.ggml.model == "gpt2"`` stores).
* :func:`tiny_tokenizer` is the random presets' small real tokenizer, trained on a fixed text.
* :func:`apply_chat_template` renders a template the way HF tokenizers do (sandboxed Jinja).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from .errors import ModelError

# GGUF token types (llama.cpp's vocab): 3 control (special), 4 user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4

# Split expressions before byte-level BPE, by GGUF ``tokenizer.ggml.pre`` name.
_SPLITS = {
    # (split applied before the GPT-2 pattern, or None; the byte-level pattern)
    "gpt2": (None, True),
    "default": (None, True),
    "smollm": ("digits", True),      # every digit alone, then GPT-2's pattern (StarCoder-style)
    "starcoder": ("digits", True),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+", False),
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+", False),
}

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(path):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ModelError(f"tokenizer: {path} is not a valid tokenizer.json: {exc}") from exc


def read_chat_template(folder) -> str | None:
    """The folder's chat template: ``chat_template.jinja`` or ``tokenizer_config.json``'s entry."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        template = json.loads(cfg.read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"tokenizer_config: {cfg} is not readable JSON: {exc}") from exc
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], *, token_types: Sequence[int] | None = None,
                   pre: str = "gpt2", bos_token_id: int | None = None, add_bos: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF-style vocabulary data.

    Args:
        tokens: the vocabulary in id order, in the byte-level alphabet (``Ġ`` for a space).
        merges: ``"left right"`` strings in priority order.
        token_types: per token, llama.cpp's type (3 = control: a special token; 4 = user-defined:
            an added token); None treats every token as normal.
        pre: the pre-tokenizer name (``tokenizer.ggml.pre``): one of ``gpt2``, ``smollm``,
            ``starcoder``, ``qwen2``, ``llama-bpe``.
        bos_token_id, add_bos: prepend the BOS token when encoding (``tokenizer.ggml.add_bos_token``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if pre not in _SPLITS:
        raise ModelError(f"tokenizer.ggml.pre: {pre!r} is not supported; expected one of {sorted(_SPLITS)}")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError("tokenizer.ggml.tokens: the vocabulary holds duplicate tokens")
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise ModelError(f"tokenizer.ggml.merges: {m!r} does not join two vocabulary tokens")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split, use_regex = _SPLITS[pre]
    steps = []
    if split == "digits":
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    elif split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if add_bos:
        if bos_token_id is None:
            raise ModelError("tokenizer.ggml.add_bos_token: set, but no tokenizer.ggml.bos_token_id")
        bos = tokens[bos_token_id]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, bos_token_id)])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if token_types is not None:
        added = [AddedToken(t, special=ty == _CONTROL, normalized=False)
                 for t, ty in zip(tokens, token_types) if ty in (_CONTROL, _USER_DEFINED)]
        tok.add_tokens([a for a in added if not a.special])
        tok.add_special_tokens([a for a in added if a.special])
    return tok


# The random presets' tokenizer is trained on this fixed text (a byte-level BPE; 3 special tokens).
_TINY_TEXT = """\
The cache keeps the keys and values of every layer for the tokens a request has seen. A leader request
computes the shared segments once; the children that repeat them later restore the saved blocks,
rotate the keys to their new positions and recompute a few tokens whose context changed. The capital
of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. Numbers: 0 1 2 3 4
5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024. What is the answer? The answer is yes, and it is no.
A model reads text as tokens; a tokenizer splits words into pieces that it knows, and falls back to
single bytes for anything else. Questions, answers, documents, segments, blocks, layers and heads.
"""
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_tokenizer(vocab_size: int = 512):
    """A small byte-level BPE tokenizer (ids below ``vocab_size``), the same on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TINY_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TINY_TEXT.splitlines(), trainer=trainer)
    return tok


def apply_chat_template(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                        **special_tokens) -> str:
    """Render a chat template as HF tokenizers do (Jinja sandbox, ``trim_blocks``/``lstrip_blocks``).

    ``special_tokens`` are passed to the template (``bos_token="..."``, ``eos_token="..."``).
    """
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ModelError(f"chat_template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                **special_tokens)
    except TemplateError as exc:
        raise ModelError(f"chat_template: {exc}") from exc
