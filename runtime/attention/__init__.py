"""Attention: dense causal attention, page key summaries, batched page selection, decode attention."""

from kvdrive.runtime.attention.dense import causal_attention
from kvdrive.runtime.attention.selection import (
    NEIGHBOUR_SHARE,
    SELECTION_CARRIES,
    SELECTION_RESTS,
    SelectionConfig,
    SelectionMasks,
    SketchWeights,
    page_scores,
    resolve_rest,
    rest_of_pages,
    select_pages,
    selection_masks,
    sketch_logits,
    sketch_weights,
    sketched_rest,
)
from kvdrive.runtime.attention.sparse import decode_attention
from kvdrive.runtime.attention.summaries import SummaryTable, key_bounds, key_codes, spread_to_neighbours

__all__ = ["NEIGHBOUR_SHARE", "SELECTION_CARRIES", "SELECTION_RESTS", "SelectionConfig", "SelectionMasks", "SketchWeights", "SummaryTable",
           "causal_attention", "decode_attention", "key_bounds", "key_codes", "page_scores", "resolve_rest",
           "rest_of_pages",
           "select_pages", "selection_masks", "sketch_logits", "sketch_weights", "sketched_rest", "spread_to_neighbours"]
