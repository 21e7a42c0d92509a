"""The byte-level BPE tokenizer and chat template that `pdserve make-model` presets ship (no torch)."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")  # ids 0..3
BOS_ID, EOS_ID, IM_END_ID = 0, 1, 3
GENERATION_EOS_IDS = (EOS_ID, IM_END_ID)  # generation_config.json's list; config.json names only EOS_ID
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Training text for the tokenizer: fixed, so the merges (and token ids) never change.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads the prompt once, then writes one token at a time.
Prefill is compute-bound: its matrix products are large. Decode is memory-bound: it reads every weight per step.
def forward(self, input_ids, positions):
    hidden = self.embed(input_ids)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Once upon a time there was a small server that carried the key-value cache from one machine to another.
The scheduler admits requests, the blocks are allocated, and the engine runs the model in a continuous batch.
Café, naïve, résumé, Zürich, São Paulo, Ελληνικά, русский, 日本語, 中文, 한국어, emoji 🙂🚀.
{"role": "user", "content": "Write a haiku about the sea."} {"role": "assistant", "content": "Waves fold into foam."}
"""



def build_tokenizer(vocab_size: int = 500) -> Tokenizer:
    """Train the byte-level BPE tokenizer a preset ships (deterministic; 65536 tokens train in under 2 s)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = _CORPUS.splitlines()
    if vocab_size > 500:  # the fixed text runs out of merges near 500 tokens
        lines += _pseudo_words(vocab_size)
    tokenizer.train_from_iterator(lines, trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    # BOS through the post-processor, as Llama 3's tokenizer.json does it
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, BOS_ID)]),
    ])
    return tokenizer


def _pseudo_words(num_words: int) -> list[str]:
    """Lines of `num_words` made-up words of 2-4 syllables, enough merges for a large vocabulary."""
    rng = random.Random(0)  # random() is stable across Python versions for a given int seed
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
    words = [
        "".join(syllables[int(rng.random() * len(syllables))] for _ in range(2 + int(rng.random() * 3)))
        for _ in range(num_words)
    ]
    return [" ".join(words[i : i + 16]) for i in range(0, num_words, 16)]
