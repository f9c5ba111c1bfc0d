"""Causal language modelling: a decoder LLM on JSONL instructions or plain text, scored by the dev
answers' perplexity (`tasks.causal_lm.task.CAUSAL_LM`; the rows of a run in `tasks.causal_lm.rows`)."""
