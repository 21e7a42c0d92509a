"""The `tokenizers` tokenizer and tokenizer_config a GGUF file describes in its `tokenizer.*` metadata (no torch).

Byte-level BPE (`tokenizer.ggml.model` "gpt2", as Llama 3, Qwen2, SmolLM and most recent models ship) is
rebuilt from the vocabulary and merges, with the pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`
(llama-vocab.cpp). SentencePiece BPE vocabularies ("llama": Llama 2, Mistral v0.1-v0.3) become a BPE with
byte fallback whose merges are recovered from the token scores, as transformers' GGUF reader builds them.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from services.gguf_file import GGUFError, GGUFFile

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (digits one by one first, the split regex, merges ignored for whole-vocabulary words)
_PRE_TOKENIZERS = {
    "default": (False, _GPT2_REGEX, False), "gpt-2": (False, _GPT2_REGEX, False),
    **{name: (True, _GPT2_REGEX, False) for name in ("smollm", "starcoder", "refact", "codeshell", "exaone",
                                                     "minerva", "command-r")},
    **{name: (False, _LLAMA3_REGEX, True) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe",
                                                       "falcon3", "dbrx", "pixtral")},
    **{name: (False, _QWEN2_REGEX, False) for name in ("qwen2", "deepseek-r1-qwen")},
}


def build_tokenizer(gguf: GGUFFile) -> tuple[Tokenizer, dict]:
    """(tokenizer.json's tokenizer, tokenizer_config.json's contents) for `gguf`."""
    kind = gguf.value("tokenizer.ggml.model", str)
    if kind not in ("gpt2", "llama"):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model is {kind!r}; supported: 'gpt2' (byte-level BPE), "
                        "'llama' (SentencePiece BPE)")
    tokens = gguf.value("tokenizer.ggml.tokens", list)
    types = gguf.value("tokenizer.ggml.token_type", list, [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    tokenizer = _byte_level(gguf, tokens) if kind == "gpt2" else _sentencepiece(gguf, tokens)
    # llama.cpp matches control and user-defined tokens whole in the text, before BPE.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tokenizer, _tokenizer_config(gguf, tokens, add_bos_default=kind == "llama")


def _byte_level(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    pre = gguf.value("tokenizer.ggml.pre", str, "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer pdserve does not know; "
                        f"known: {', '.join(sorted(_PRE_TOKENIZERS))}")
    digits, regex, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in gguf.value("tokenizer.ggml.merges", list)]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE: `▁` for spaces (and before the text, unless add_space_prefix is false), pieces merged
    best score first, bytes (<0x41>) for what no piece covers."""
    scores = gguf.value("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unknown = gguf.value("tokenizer.ggml.unknown_token_id", int, 0)
    if not 0 <= unknown < len(tokens):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.unknown_token_id is {unknown}, not below {len(tokens)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unknown], fuse_unk=True, byte_fallback=True))
    prefix = gguf.value("tokenizer.ggml.add_space_prefix", bool, True)
    # As Llama 2's own tokenizer.json and llama.cpp do: every text fragment (the whole text, or what follows a
    # special token) gets its `▁`, even one that starts with a space (transformers' GGUF reader adds none there).
    tokenizer.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                                + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token's score (then the shorter
    left piece), as transformers' `generate_merges` recovers them."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _tokenizer_config(gguf: GGUFFile, tokens: list[str], add_bos_default: bool) -> dict:
    def token(key: str) -> str | None:
        token_id = gguf.value(f"tokenizer.ggml.{key}_token_id", int, None)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFError(f"{gguf.path}: tokenizer.ggml.{key}_token_id is {token_id}, not below {len(tokens)}")
        return None if token_id is None else tokens[token_id]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"),
        # absent: BOS for SentencePiece (llama.cpp's default), none for byte-level BPE, as transformers reads them
        "add_bos_token": gguf.value("tokenizer.ggml.add_bos_token", bool, add_bos_default),
        "add_eos_token": gguf.value("tokenizer.ggml.add_eos_token", bool, False),
        "clean_up_tokenization_spaces": False,
        "chat_template": gguf.value("tokenizer.chat_template", str, None),
    }
