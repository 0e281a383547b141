"""Speculative decoding (issue 22): the config (spec/config.py) and the n-gram proposer (spec/ngram.py)."""
