"""The `tokenizers` tokenizer and tokenizer_config a GGUF file describes in its `tokenizer.*` metadata (no torch).

Byte-level BPE (`tokenizer.ggml.model` "gpt2", as Llama 3, Qwen2, SmolLM and most recent models ship) is
rebuilt from the vocabulary and merges, with the pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`
(llama-vocab.cpp). SentencePiece vocabularies ("llama": Llama 2, Mistral v0.1) are refused by name.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

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
    if kind != "gpt2":
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    pre = gguf.value("tokenizer.ggml.pre", str, "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer pdserve does not know; "
                        f"known: {', '.join(sorted(_PRE_TOKENIZERS))}")
    digits, regex, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens = gguf.value("tokenizer.ggml.tokens", list)
    merges = [tuple(m.split(" ", 1)) for m in gguf.value("tokenizer.ggml.merges", list)]
    types = gguf.value("tokenizer.ggml.token_type", list, [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    # llama.cpp matches control and user-defined tokens whole in the text, before BPE.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tokenizer, _tokenizer_config(gguf, tokens)


def _tokenizer_config(gguf: GGUFFile, tokens: list[str]) -> dict:
    def token(key: str) -> str | None:
        token_id = gguf.value(f"tokenizer.ggml.{key}_token_id", int, None)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GGUFError(f"{gguf.path}: tokenizer.ggml.{key}_token_id is {token_id}, not below {len(tokens)}")
        return None if token_id is None else tokens[token_id]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"),
        # absent from a BPE file: no BOS, as transformers reads such a file
        "add_bos_token": gguf.value("tokenizer.ggml.add_bos_token", bool, False),
        "add_eos_token": gguf.value("tokenizer.ggml.add_eos_token", bool, False),
        "clean_up_tokenization_spaces": False,
        "chat_template": gguf.value("tokenizer.chat_template", str, None),
    }
