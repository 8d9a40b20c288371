"""Tokenizer service: chat template + HF tokenizers on `strata.tok.encode` (queue group)."""
