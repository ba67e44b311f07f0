"""Speculative decoding: its configuration (config.py), the verification rules (verify.py) and the
DSpark decoding loop (decoder.py)."""
