"""What a prompt is, without torch: its tokens (the model's tokenizer and chat template) and the content
addresses of its pages (prefix digests). Shared by the runtime and the router (``kvdrive route``)."""

from kvdrive.runtime.prompt.digests import DIGEST_BYTES, chain_digest, page_digests, root_digest, salted_root
from kvdrive.runtime.prompt.tokenizer import ChatMessage, Tokenizer, TokenizerError

__all__ = ["DIGEST_BYTES", "ChatMessage", "Tokenizer", "TokenizerError", "chain_digest", "page_digests",
           "root_digest", "salted_root"]
