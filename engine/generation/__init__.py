"""One sequence token by token: prefill, then decode (generate.py: Generation's decisions per token, grammar,
stop strings, logprobs), the samplers and logits processors (sampling.py), and drafts guessed from the sequence's
own n-grams (speculation.py)."""
