"""How many prompt tokens the next step may carry so that it ends within a latency target.

Every running decode waits for the whole step, so a step's length is every stream's inter-token gap. A
fixed token budget (``--step-tokens``) is right for one machine and load and wrong for the next: on a
2-core host under 16 clients a 256-token step took 2-2.5 s (the soak in docs/reliability.md). The pacer
sizes the prompt share of each step from what steps have cost, as Sarathi-Serve sizes its prefill chunks
to a time-between-tokens target:

    step seconds ~ base (a decode-only step) + per_token * prompt tokens     (both moving averages)
    prompt budget = (target - base) / per_token, within [min_prompt_tokens, step_token_budget - decodes]

Decodes are never cut, and the oldest prompt keeps its share of whatever budget there is (the
scheduler's rule), so a tight target slows prefill, never stops it. A step with no decode in it waits on
nobody and keeps the full budget. Target 0 turns pacing off.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest step in the moving averages


@dataclass
class StepPacer:
    target_s: float  # 0: off (the fixed budget)
    max_tokens: int  # the scheduler's step_token_budget: the pacer only ever lowers it
    min_prompt_tokens: int = 16  # prompt tokens a step may always carry (one page at the default size)
    base_s: float = 0.0  # a decode-only step (0 until one was seen)
    per_token_s: float = 0.0  # each prompt token on top (0 until a step with prompt tokens was seen)

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        """A step's forward pass took ``seconds`` with ``prompt_tokens`` prompt tokens in it."""
        if prompt_tokens == 0:
            self.base_s = seconds if not self.base_s else (1 - ALPHA) * self.base_s + ALPHA * seconds
        elif prompt_tokens >= self.min_prompt_tokens:
            per = max(0.0, seconds - self.base_s) / prompt_tokens
            self.per_token_s = per if not self.per_token_s else (1 - ALPHA) * self.per_token_s + ALPHA * per

    def budget(self, decodes: int) -> int:
        """The next step's token budget (decodes included) for ``decodes`` decoding sequences."""
        if not self.target_s or not self.per_token_s or not decodes:
            return self.max_tokens  # nobody is waiting for a token: the step may be as long as its prompts need
        fit = int((self.target_s - self.base_s) / self.per_token_s)
        prompt = max(self.min_prompt_tokens, min(fit, self.max_tokens - decodes))
        return decodes + prompt
