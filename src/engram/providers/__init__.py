"""Providers behind minimal interfaces: embedders (`embed_batch`) and LLMs (`complete`)."""
