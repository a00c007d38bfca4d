"""Providers: embedders (and, later, language models and tokenizers) behind minimal interfaces."""
