"""Corpus, tokenizer, target training and drafter distillation for the bundled demo models."""
