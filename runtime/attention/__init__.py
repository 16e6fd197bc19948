"""Attention: dense causal attention; page summaries, page selection and sparse attention."""

from kvdrive.runtime.attention.dense import causal_attention

__all__ = ["causal_attention"]
