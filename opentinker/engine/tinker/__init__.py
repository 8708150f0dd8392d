"""What the Tinker API runs on the engine side: a training client's model
(:mod:`.model_worker`), samplers (:mod:`.sampler_worker`, scheduled by :mod:`.sample_scheduler`)
and the datum conversion (:mod:`.datums`). This file imports nothing heavy: the server reads it."""

#: ``max_tokens`` of a sampling request that sets none: up to the context's end, at most this.
DEFAULT_MAX_TOKENS = 1024


def default_max_tokens(prompt_length: int, context: int) -> int:
    """``max_tokens`` of a request that sets none, for a prompt of ``prompt_length`` tokens."""
    return max(1, min(DEFAULT_MAX_TOKENS, context - prompt_length))
