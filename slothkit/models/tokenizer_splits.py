"""The regexes byte-level BPE families split text with before BPE, written once: the tiny
and real test tokenizers (slothkit.testing) are built with them, and GGUF export
(slothkit.export.gguf.pre_tokenizer) recognises them to name llama.cpp's pre-tokenizer."""

# Llama 3: tiktoken's cl100k regex (case-insensitive contractions, words, numbers in groups of
# at most three digits, punctuation runs, newlines and other whitespace).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 (Qwen1.5 to Qwen3): Llama 3's with every digit a piece of its own.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen3.5: Qwen2's with combining marks kept inside words (a letter's accents and the vowel
# signs of Indic scripts join its piece rather than the punctuation run after it).
QWEN3_5_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
