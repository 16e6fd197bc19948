"""Attention: dense causal attention; page summaries, page selection and sparse attention."""

from kvdrive.runtime.attention.dense import causal_attention
from kvdrive.runtime.attention.selection import (
           SelectionConfig,
           page_scores,
           select_pages,
           select_with_runners_up,
)
from kvdrive.runtime.attention.sparse import decode_attention
from kvdrive.runtime.attention.summaries import PageSummaries, key_bounds

__all__ = ["PageSummaries", "SelectionConfig", "causal_attention", "decode_attention", "key_bounds",
           "page_scores", "select_pages", "select_with_runners_up"]
